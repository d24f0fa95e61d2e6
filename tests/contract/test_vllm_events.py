"""vLLM's KV events decoded without vLLM (unicache/contract/vllm_events.py) and what the router
builds from them (router/upstream/vllm_fleet): exact hashes, tiers, counts and index contents."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import grpc
import msgspec
import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.kv_tier import Tier
from unicache.plumbing.errors import UsageError
from unicache.router.cluster.index import LocalityIndex
from unicache.router.upstream.vllm_fleet.follower import apply_events, parse_vllm_metrics
from unicache.router.upstream.vllm_fleet.http_stream import _status_error, completion_body, parse_chunk
from unicache.router.upstream.vllm_fleet.spec import BackendSpec, parse_backend, parse_backends
from unicache.v1 import common_pb2, replica_pb2
from unicache.contract.vllm_events import (
    EXTRA_ARGS_KEY,
    EventTranslator,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    class_from_vllm,
    decode_batch,
)

FIXTURE = Path(__file__).parents[1] / "support" / "vllm_kv_events_0_32.json"
BS = 4


def batch(*events) -> VllmEventBatch:
    return decode_batch(msgspec.msgpack.encode(VllmEventBatch(ts=1.0, events=list(events))))


def stored(hashes, parent, tokens, salt=None, medium="GPU") -> VllmBlockStored:
    extra = [[salt]] + [None] * (len(hashes) - 1) if salt else None
    return VllmBlockStored(hashes, parent, tokens, BS, medium=medium, extra_keys=extra)


def test_a_batch_a_real_vllm_server_published_decodes_to_our_hashes():
    doc = json.loads(FIXTURE.read_text())
    (entry,) = doc["batches"]
    b = decode_batch(base64.b64decode(entry["payload_b64"]))
    (ev,) = b.events
    assert isinstance(ev, VllmBlockStored) and ev.block_size == 32 and ev.parent_block_hash is None
    assert len(ev.block_hashes) == 3 and len(ev.token_ids) == 96 and ev.medium == "GPU"
    out = EventTranslator(clock=lambda: 5.0).translate(b)
    expected = hash_token_blocks(ev.token_ids, 32, cache_salt=bytes.fromhex("cd" * 8))
    assert [e.block_hash for e in out] == expected
    assert [e.parent_hash for e in out] == [None, *expected[:2]]


def test_translator_counts_duplicates_and_emits_at_zero():
    t = EventTranslator(clock=lambda: 5.0)
    toks = list(range(8))
    ours = hash_token_blocks(toks, BS)
    assert [e.block_hash for e in t.translate(batch(stored([1, 2], None, toks)))] == ours
    assert t.translate(batch(stored([1], None, toks[:4]))) == []  # a second vLLM block, same content
    assert t.translate(batch(VllmBlockRemoved([1], medium="GPU"))) == []  # one copy left
    assert t.translate(batch(VllmBlockRemoved([1, 2], medium="GPU"))) == [BlockRemoved(ours[0], 5.0), BlockRemoved(ours[1], 5.0)]
    assert len(t) == 0


def test_salt_separates_tenants_and_children_chain_from_their_parent():
    t = EventTranslator(clock=lambda: 0.0)
    toks = list(range(12))
    salt = bytes.fromhex("ab" * 8)
    first = t.translate(batch(stored([10], None, toks[:4], salt="ab" * 8)))
    rest = t.translate(batch(stored([11, 12], 10, toks[4:])))
    assert [e.block_hash for e in first + rest] == hash_token_blocks(toks, BS, cache_salt=salt)
    assert hash_token_blocks(toks, BS, cache_salt=salt)[0] != hash_token_blocks(toks, BS)[0]


def test_cpu_medium_is_the_host_tier_and_other_media_are_ignored():
    t = EventTranslator(clock=lambda: 0.0)
    toks = list(range(4))
    (h,) = hash_token_blocks(toks, BS)
    assert t.translate(batch(stored([7], None, toks, medium="CPU"))) == [BlockStored(h, None, 0.0, Tier.HOST)]
    assert t.translate(batch(stored([8], None, toks, medium="STORAGE"))) == []
    assert t.cached_hashes(Tier.HOST) == [h] and t.cached_hashes() == []


def test_unknown_parent_or_impossible_claim_resets_the_table():
    t = EventTranslator(clock=lambda: 0.0, max_entries=2)
    assert t.translate(batch(stored([5], 99, list(range(4))))) == [AllBlocksCleared(0.0)]
    assert t.lost == 1
    out = t.translate(batch(stored([1, 2, 3], None, list(range(12)))))
    assert out[-1] == AllBlocksCleared(0.0) and len(t) == 0 and t.lost == 2
    assert t.translate(batch(VllmAllBlocksCleared())) == [AllBlocksCleared(0.0)]


def test_a_batch_that_stores_before_it_removes_is_judged_at_its_end():
    """A full pool's batch may name its new blocks before the ones they replace: only what
    the table holds once the batch is applied is held against the pool's size."""
    t = EventTranslator(clock=lambda: 0.0, max_entries=2)
    t.translate(batch(stored([1, 2], None, list(range(8)))))
    out = t.translate(batch(stored([3], 2, list(range(8, 12))), VllmBlockRemoved([1], medium="GPU")))
    assert AllBlocksCleared(0.0) not in out and len(t) == 2 and t.lost == 0
    out = t.translate(batch(stored([4], 3, list(range(12, 16)))))  # three held: more than the pool
    assert out[-1] == AllBlocksCleared(0.0) and len(t) == 0 and t.lost == 1


def test_events_fill_the_index_exactly():
    index = LocalityIndex()
    t = EventTranslator(clock=lambda: 0.0)
    toks = list(range(12))
    hashes = hash_token_blocks(toks, BS)
    apply_events(index, "b", t.translate(batch(stored([1, 2, 3], None, toks))))
    assert index.match("b", hashes) == 3
    apply_events(index, "b", t.translate(batch(VllmBlockRemoved([3], medium="GPU"), stored([3], 2, toks[8:]))))
    assert index.match("b", hashes) == 3
    apply_events(index, "b", t.translate(batch(VllmBlockRemoved([3], medium="GPU"))))
    assert index.match("b", hashes) == 2 and index.num_blocks("b") == 2
    apply_events(index, "b", t.translate(batch(VllmAllBlocksCleared(), stored([1], None, toks[:4]))))
    assert index.match("b", hashes) == 1 and index.num_blocks("b") == 1


def test_backend_specs_parse_and_refuse_by_name():
    assert parse_backend("http://10.0.0.5:8000,kv-events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558") == BackendSpec(
        "vllm-10.0.0.5-8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"
    )
    assert parse_backend("https://a.example/,id=a").backend_id == "a"
    assert [s.backend_id for s in parse_backends('["http://h:1,id=x", "http://h:2"]')] == ["x", "vllm-h-2"]
    assert [s.url for s in parse_backends("http://h:1;http://h:2\n")] == ["http://h:1", "http://h:2"]
    for bad, words in [
        ("h:8000", "http(s)://host:port"),
        ("http://h:1/v1", "no path"),
        ("http://h:1,kv=tcp://h:2", "unknown option 'kv=tcp://h:2'"),
        ("http://h:1,kv-events=h:2", "kv-events must be a tcp://HOST:PORT"),
    ]:
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_backend(bad)
    with pytest.raises(UsageError, match="two backends have the id 'x'"):
        parse_backends("http://h:1,id=x;http://h:2,id=x")


def test_completion_body_carries_tokens_salt_class_and_sampling():
    cls = common_pb2.RequestClass(tenant="t", session_id="s", turn=2, task="chat")
    req = replica_pb2.GenerateRequest(
        token_ids=replica_pb2.TokenIds(ids=[5, 6, 7]), cache_salt=b"\x01\x02", request_class=cls,
        sampling=common_pb2.SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=["x"], n=2, logprobs=1),
    )
    body = completion_body("m", req)
    assert class_from_vllm(body["vllm_xargs"][EXTRA_ARGS_KEY]) == cls
    del body["vllm_xargs"]
    assert body == {
        "model": "m", "prompt": [5, 6, 7], "temperature": 0.5, "top_p": 1.0, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True, "max_tokens": 9, "seed": 3, "stop": ["x"],
        "logprobs": 1, "return_tokens_as_token_ids": True, "cache_salt": "0102",
    }
    fill = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=[1]), sampling=common_pb2.SamplingParams(fill_context=True))
    assert "max_tokens" not in completion_body("m", fill) and "cache_salt" not in completion_body("m", fill)


def test_stream_chunks_become_our_messages():
    (msg,) = parse_chunk({"choices": [{"index": 1, "text": " w5", "token_ids": [8], "finish_reason": "length",
                                       "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:8": -0.5, "token_id:9": -1.5}]}}]})
    assert (msg.index, msg.text, list(msg.token_ids), msg.finish_reason) == (1, " w5", [8], common_pb2.FINISH_REASON_LENGTH)
    assert msg.logprobs[0].logprob == -0.5 and [(t.token_id, t.logprob) for t in msg.logprobs[0].top] == [(8, -0.5), (9, -1.5)]
    (usage,) = parse_chunk({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}}})
    assert (usage.usage.prompt_tokens, usage.usage.cached_tokens, usage.usage.completion_tokens) == (100, 64, 5)


@pytest.mark.parametrize(
    "status, code",
    [(400, grpc.StatusCode.INVALID_ARGUMENT), (404, grpc.StatusCode.INVALID_ARGUMENT), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
     (503, grpc.StatusCode.UNAVAILABLE), (500, grpc.StatusCode.INTERNAL)],
)
def test_backend_statuses_map_to_the_replica_codes(status, code):
    err = _status_error(status, json.dumps({"error": {"message": "too long"}}).encode())
    assert err.code() == code and "too long" in err.details()


def test_vllm_metrics_page_gives_load_and_pool():
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0',
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="32",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0',
    ])
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 1.0, "usage": 0.25, "prefix_hits": 64.0, "gpu_blocks": 2048, "block_size": 32}


def test_vllm_histograms_feed_the_cost_model_between_scrapes():
    from unicache.router.routing.cost_model import CostModel
    from unicache.router.upstream.vllm_fleet.follower import observe_histograms

    def page(prefill_sum, prefill_n, prompt, cached, tpot_sum, tpot_n):
        return "\n".join([
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 4.0',
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}',
            "# TYPE vllm:prompt_tokens_cached_total counter",
            f'vllm:prompt_tokens_cached_total{{engine="0",model_name="m"}} {cached}',
            "# TYPE vllm:request_prefill_time_seconds histogram",
            f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {prefill_n}',
            f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {prefill_sum}',
            f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {prefill_n}',
            "# TYPE vllm:request_time_per_output_token_seconds histogram",
            f'vllm:request_time_per_output_token_seconds_sum{{engine="0",model_name="m"}} {tpot_sum}',
            f'vllm:request_time_per_output_token_seconds_count{{engine="0",model_name="m"}} {tpot_n}',
        ])

    before = parse_vllm_metrics(page(1.0, 10, 5000, 1000, 2.0, 100))
    after = parse_vllm_metrics(page(1.5, 14, 6000, 1400, 2.6, 120))
    assert (after["prefill_time_sum"], after["prefill_time_count"], after["prompt_tokens"], after["prompt_tokens_cached"],
            after["tpot_sum"], after["tpot_count"], after["running"]) == (1.5, 14.0, 6000.0, 1400.0, 2.6, 120.0, 4.0)
    model = CostModel()
    observe_histograms(model, "b", before, after)
    ttft, itl = model._ttft.rings["b"], model._itl.rings["b"]
    # 4 requests prefilled in 0.5 s over 600 uncached tokens: 0.125 s at 150 tokens, nothing ahead
    assert ttft._xs == [(150.0, 0.0)] and ttft._ys == [pytest.approx(0.125)]
    assert itl._xs == [(4.0,)] and itl._ys == [pytest.approx(0.03)]


def test_an_impossible_claim_drops_the_backends_blocks():
    from unicache.router.cluster.view import ClusterView
    from unicache.router.routing.registry import make_routing_policy
    from unicache.router.upstream.vllm_fleet.follower import BackendFollower
    from unicache.router.upstream.vllm_fleet.http_stream import VllmClients

    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    f = BackendFollower(parse_backend("http://127.0.0.1:1,id=b"), cluster, VllmClients(), BS)  # no events: no subscriber
    cluster.index.set_capacity("b", 2)
    f.capacity_blocks = 2
    toks = list(range(8))
    f.apply([batch(stored([1, 2], None, toks))])
    assert cluster.index.match("b", hash_token_blocks(toks, BS)) == 2 and f.breaks == 0
    f.apply([batch(stored([3], 2, list(range(8, 12))))])  # a third block in a 2-block pool
    assert (cluster.index.num_blocks("b"), len(f.translator), f.breaks) == (0, 0, 1)
