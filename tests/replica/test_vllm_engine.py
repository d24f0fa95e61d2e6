"""vLLM as the replica's engine, end to end, on a tiny random-weight Llama the test writes.

Engines in this module (each start costs ~45 s or more on 2 cores): vLLM's own ``LLM`` for
the reference tokens (stopped before the rest starts), one replica with ``--engine vllm``
and ``unicache`` eviction behind the router (plus a built-in torch replica as the other
choice), and for the eviction comparison one engine with vLLM's own LRU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import pytest_asyncio

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.redis_keys import RedisKeys
from unicache.contract.request_class import RequestClass, Task
from unicache.contract.state_auth import parse_cluster_key
from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.replica.engines.vllm.config import VLLMEngineConfig
from unicache.replica.engines.vllm.engine import VLLMEngine
from unicache.replica.publishing.publisher import CachePublisher
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.serving.server import ReplicaServer
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, SIGNER, call_metadata
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BS = 32
NUM_BLOCKS = 64
PREFIX = "vllm-e2e"
MAX_TOKENS = 12


def text(start: int, n: int, step: int = 1) -> str:
    """n words of the test tokenizer, one token each."""
    return " ".join(WORDS[(start + i * step) % len(WORDS)] for i in range(n))


PROMPTS = [text(0, 100), text(7, 75, 3), text(200, 140, 7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def vllm_config(model_dir: str, policy: str) -> VLLMEngineConfig:
    return VLLMEngineConfig(model=model_dir, block_size=BS, num_blocks=NUM_BLOCKS, eviction_policy=policy, device="cpu", dtype="float32", max_num_seqs=8)


# Sampling options beyond greedy, as vLLM's own SamplingParams and as our replica's proto.
# Negative penalties favour tokens already generated: the greedy outputs here repeat
# nothing, so positive ones would change nothing.
OPTIONS = dict(presence_penalty=-1.5, frequency_penalty=-2.0, logprobs=3)


@dataclasses.dataclass
class Reference:
    greedy: list[list[int]]  # greedy tokens per prompt
    penalized: list[list[int]]  # per prompt, with OPTIONS
    penalized_logprobs: list[list[dict[int, tuple[float, int]]]]  # per prompt, per token: {id: (logprob, rank)}
    stopped: list[int]  # PROMPTS[1] greedy with stop_token_ids = [its third token]


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    """Tokens of ``PROMPTS`` from vLLM's own ``LLM.generate`` (no hook of ours)."""
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    from unicache.contract.tokenizer import load_tokenizer

    args = vllm_config(model_dir, "vllm").engine_args("cpu", "ipc:///tmp/unused-e", "ipc:///tmp/unused-r", "")
    for ours in ("scheduler_cls", "additional_config", "kv_events_config"):
        args.pop(ours)
    llm = LLM(**args)
    try:
        tok = load_tokenizer(f"{model_dir}/tokenizer.json")
        outs = llm.generate(
            [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS],
            VSamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        )
        greedy = [list(o.outputs[0].token_ids) for o in outs]
        pen = llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS], VSamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **OPTIONS))
        (stop,) = llm.generate(
            [{"prompt_token_ids": tok.encode(PROMPTS[1])}], VSamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[greedy[1][2]])
        )
        return Reference(
            greedy,
            [list(o.outputs[0].token_ids) for o in pen],
            [[{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in pen],
            list(stop.outputs[0].token_ids),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()


@dataclasses.dataclass
class Stack:
    runtime: ReplicaRuntime
    replica: replica_pb2_grpc.ReplicaStub
    router: RouterApp
    router_stub: router_pb2_grpc.RouterStub


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(model_dir, reference):
    redis = EmbeddedRedis()
    redis.start()
    settings = ReplicaSettings(
        replica_id="v0", engine="vllm", checkpoint=model_dir, block_size=BS, num_blocks=NUM_BLOCKS, eviction_policy="unicache",
        device="cpu", dtype="float32", max_num_seqs=8, redis_url=redis.url, redis_prefix=PREFIX,
        cluster_key=CLUSTER_KEY, insecure_no_tls=True,
    )
    runtime = ReplicaRuntime(settings)
    try:
        address = await runtime.start()
    except BaseException:
        redis.close()  # a failed engine start must not leave the redis-server behind
        raise
    # The other choice: a built-in torch replica with the same tokenizer and block size.
    torch_engine = AsyncEngine(
        EngineConfig(
            model=ModelConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position=4096),
            tokenizer=f"{model_dir}/tokenizer.json", block_size=BS, num_blocks=NUM_BLOCKS, eviction_policy="lru", device="cpu",
        )
    )
    await torch_engine.start()
    torch_server = ReplicaServer(torch_engine, "t0", cluster_key=parse_cluster_key(CLUSTER_KEY))
    port = await torch_server.start()
    torch_pub = CachePublisher(
        torch_engine, "t0", redis.url, f"127.0.0.1:{port}", RedisKeys(PREFIX), heartbeat_interval_s=0.1, signer=SIGNER
    )
    torch_server.servicer.summary_source = torch_pub.signed_summary
    await torch_pub.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "ka:acme,kb:beta", "UNICACHE_SALT_SECRET": "s"},
        overrides={
            "grpc_port": 0, "http_port": 0, "redis_url": redis.url, "redis_prefix": PREFIX, "block_size": BS,
            "tokenizer": f"{model_dir}/tokenizer.json", "cluster_key": CLUSTER_KEY, "insecure_no_tls": True,
        },
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05})
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["t0", "v0"] and not app.index.needs_resync("v0"), "replicas", timeout_s=60)
    replica_channel = grpc.aio.insecure_channel(address)
    router_channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    try:
        yield Stack(runtime, replica_pb2_grpc.ReplicaStub(replica_channel), app, router_pb2_grpc.RouterStub(router_channel))
    finally:
        await replica_channel.close()
        await router_channel.close()
        await app.stop()
        await torch_pub.stop()
        await torch_server.stop()
        await torch_engine.stop()
        await runtime.stop()
        redis.close()


async def generate(stub, prompt: str | list[int], salt: bytes = b"", cls: RequestClass | None = None, max_tokens: int = MAX_TOKENS,
                   messages: list | None = None, **sampling):
    """One request straight to the replica (text or token ids): (token ids, last message's usage).
    ``messages``, when given, collects every response message."""
    from unicache.contract import wire
    req = replica_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling), cache_salt=salt,
        request_class=wire.request_class_to_proto(cls or RequestClass()),
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    msgs = [m async for m in stub.Generate(req, metadata=call_metadata(), timeout=120)]
    if messages is not None:
        messages.extend(msgs)
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


async def test_greedy_tokens_equal_vllm_llm_generate(stack, reference):
    for prompt, want in zip(PROMPTS, reference.greedy):
        got, usage = await generate(stack.replica, prompt, salt=b"parity")
        assert got == want
        assert usage.completion_tokens == len(want)
    assert any(len(want) == MAX_TOKENS for want in reference.greedy)  # not every prompt ends at EOS at once


async def test_penalties_logprobs_and_stop_token_ids_reach_vllm(stack, reference):
    assert reference.penalized != reference.greedy  # the penalties change some prompt's tokens
    for prompt, want_tokens, want_lps in zip(PROMPTS, reference.penalized, reference.penalized_logprobs):
        msgs: list = []
        got, _ = await generate(stack.replica, prompt, salt=b"options", messages=msgs, **OPTIONS)
        assert got == want_tokens
        lps = [lp for m in msgs for lp in m.logprobs]
        assert len(lps) == len(got)
        for tok, lp, want in zip(got, lps, want_lps):
            assert lp.logprob == pytest.approx(want[tok][0], abs=1e-5)
            top = sorted((rank, t) for t, (_, rank) in want.items() if rank <= OPTIONS["logprobs"])
            assert [t.token_id for t in lp.top] == [t for _, t in top]
            assert [t.logprob for t in lp.top] == pytest.approx([want[t][0] for _, t in top], abs=1e-5)
    msgs = []
    stop_id = reference.greedy[1][2]
    got, _ = await generate(stack.replica, PROMPTS[1], salt=b"options", messages=msgs, stop_token_ids=[stop_id])
    assert got == reference.stopped == reference.greedy[1][: reference.greedy[1].index(stop_id) + 1]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_second_identical_request_reports_cached_tokens_and_tenants_share_nothing(stack):
    prompt = text(300, 100)  # 100 tokens: 3 full blocks (vLLM recomputes the last token)
    first, u1 = await generate(stack.replica, prompt, salt=b"tenant-a")
    second, u2 = await generate(stack.replica, prompt, salt=b"tenant-a")
    other, u3 = await generate(stack.replica, prompt, salt=b"tenant-b")
    assert (u1.prompt_tokens, u1.cached_tokens) == (100, 0)
    assert (u2.cached_tokens, u3.cached_tokens) == (96, 0)
    assert first == second == other  # same model, same greedy tokens; only the cache differs


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as client:
        body = (await client.get(url)).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))): s.value
        for f in text_string_to_metric_families(body) for s in f.samples
    }


async def test_replica_metrics_are_vllms_own_series(stack):
    """With the vLLM engine the endpoint serves vLLM's own stat logger's series (labels
    model_name and engine) beside ours; one request moves them by exactly its usage."""
    url = stack.runtime.metrics_url
    m = (("model_name", stack.runtime.engine.served_model_name),)
    before = await scrape(url)
    prompt = text(420, 70)  # 70 tokens, new to the cache
    toks, usage = await generate(stack.replica, prompt, salt=b"metrics")

    async def moved():
        after = await scrape(url)
        return after if after[("vllm:prompt_tokens_total", m)] - before[("vllm:prompt_tokens_total", m)] == 70 else None

    after = await eventually(moved, "vLLM's logger to record the request")
    delta = {k: after[k] - before.get(k, 0.0) for k in (
        ("vllm:generation_tokens_total", m), ("vllm:prefix_cache_queries_total", m), ("vllm:prefix_cache_hits_total", m),
        ("vllm:time_to_first_token_seconds_count", m), ("vllm:e2e_request_latency_seconds_count", m),
    )}
    assert delta == {
        ("vllm:generation_tokens_total", m): len(toks),
        ("vllm:prefix_cache_queries_total", m): 70,
        ("vllm:prefix_cache_hits_total", m): usage.cached_tokens,
        ("vllm:time_to_first_token_seconds_count", m): 1,
        ("vllm:e2e_request_latency_seconds_count", m): 1,
    }
    assert ("vllm:kv_cache_usage_perc", m) in after and ("vllm:num_requests_running", m) in after
    assert after[("unicache_replica_capacity_blocks", m)] == NUM_BLOCKS
    # vLLM's victims come from our unicache policy: its per-queue counts are ours to export.
    queues = sorted(q for (name, labels), _ in after.items() if name == "unicache_replica_queue_evictions_total"
                    for k, q in labels if k == "queue")
    assert queues == ["agent", "chat", "evict_first", "structural"]


async def test_events_feed_the_router_index_and_the_next_request_routes_by_it(stack):
    app, engine = stack.router, stack.runtime.engine
    prompt = text(11, 130, 5)  # 130 tokens: 4 full blocks
    salt = app.auth.cache_salt("acme")
    tokens, _ = await generate(stack.replica, prompt, salt=salt)
    done = time.time()
    ids = engine.encode(prompt)
    prompt_hashes = hash_token_blocks(ids, BS, cache_salt=salt)
    assert len(prompt_hashes) == 4
    # Our own chained hashes, recomputed from vLLM's events, reach the router's index.
    await eventually(lambda: app.index.match("v0", prompt_hashes) == 4, "prompt blocks in the index")
    assert set(app.index.holdings("v0").blocks) == set(engine.cached_hashes())
    # NOTE: a heartbeat taken after the request finished: one still showing it running makes
    # v0 look busier, and cache_aware may rightly send the next request to the idle t0.
    await eventually(
        lambda: (hb := app.cluster.replicas["v0"].heartbeat).timestamp > done and hb.running == hb.waiting == 0,
        "idle heartbeat of v0 taken after the request", timeout_s=30,
    )
    md = [("authorization", "Bearer ka")]
    req = router_pb2.RouterGenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    hop = stack.runtime.server.hop
    before = hop.streams
    msgs = [m async for m in stack.router_stub.Generate(req, metadata=md, timeout=120)]
    assert (msgs[0].route.replica_id, msgs[0].route.reason, msgs[0].route.matched_tokens) == ("v0", "index_prefix", 128)
    assert msgs[-1].usage.cached_tokens == 128
    assert [t for m in msgs for t in m.token_ids] == tokens  # over the framed hop, the tokens gRPC gave
    assert hop.streams == before + 1
    # Another tenant's same prompt matches nothing in the index.
    beta = hash_token_blocks(ids, BS, cache_salt=app.auth.cache_salt("beta"))
    assert app.index.match("v0", beta) == 0


async def test_evicted_blocks_leave_the_index(stack):
    app, engine = stack.router, stack.runtime.engine
    first = text(400, 96, 11)
    salt = b"evict"
    await generate(stack.replica, first, salt=salt)
    hashes = hash_token_blocks(engine.encode(first), BS, cache_salt=salt)
    await eventually(lambda: app.index.match("v0", hashes) == 3, "first prompt indexed")
    for k in range(8):  # 8 x 9 blocks: more than the 64-block pool holds
        await generate(stack.replica, text(k * 13, 290, 1 + k), salt=salt, max_tokens=2)
    await eventually(lambda: app.index.match("v0", hashes) == 0, "evicted blocks removed from the index")
    _, again = await generate(stack.replica, text(7 * 13, 290, 8), salt=salt, max_tokens=2)
    assert again.cached_tokens == 288  # the newest prompt's 9 full blocks are all still there
    await eventually(lambda: set(app.index.holdings("v0").blocks) == set(engine.cached_hashes()), "index equals vLLM's cache")
    state = await stack.replica.GetCacheState(replica_pb2.GetCacheStateRequest(), metadata=call_metadata(), timeout=10)
    assert (state.replica_id, state.block_size, state.capacity_blocks, state.eviction_policy) == ("v0", BS, NUM_BLOCKS, "unicache")
    assert state.used_blocks == 0 and state.free_blocks == NUM_BLOCKS
    assert state.evictions > 0 and 0.0 < state.hit_ratio < 1.0
    # Idle: every cached block is an eviction candidate in one of the policy's queues.
    assert sum(state.queue_sizes.values()) == state.cached_blocks == len(engine.cached_hashes())
    hb = await eventually(lambda: (h := app.cluster.replicas["v0"].heartbeat) and h.cache.evictions > 0 and h, "heartbeat with vLLM's pool")
    assert (hb.cache.capacity_blocks, hb.cache.eviction_policy) == (NUM_BLOCKS, "unicache")


SESSION = RequestClass(tenant="acme", session_id="chat-1", turn=0, task=Task.CHAT)


async def session_sequence(run, encode) -> tuple[int, int]:
    """A chat session's first turn (500 tokens: 16 blocks), six unique one-off prompts (310
    tokens, 10 blocks each: more than the pool has left), then the session's second turn
    (the first turn, its answer, 30 new tokens). Returns the cached prompt tokens of the
    two turns."""
    turn1 = encode(text(5, 500, 7))
    out1, u1 = await run(turn1, SESSION)
    for k in range(6):
        await run(encode(text(50 + 31 * k, 310, 3 + 2 * k)), RequestClass(tenant="acme"))
    turn2 = turn1 + out1 + encode(text(90, 30))
    _, u2 = await run(turn2, dataclasses.replace(SESSION, turn=1))
    return u1.cached_tokens, u2.cached_tokens


async def test_unicache_keeps_a_live_session_that_vllms_lru_evicts(stack, model_dir):
    ok = await stack.runtime.engine.reset_cache()
    assert ok

    async def via_replica(prompt, cls):
        return await generate(stack.replica, prompt, salt=b"sess", cls=cls, max_tokens=8)

    unicache = await session_sequence(via_replica, stack.runtime.engine.encode)
    native = VLLMEngine(vllm_config(model_dir, "vllm"))
    await native.start()
    try:

        async def direct(prompt, cls):
            req = EngineRequest(f"r{len(prompt)}-{prompt[0]}", prompt, SamplingParams(max_tokens=8), cls=cls, cache_salt=b"sess")
            toks, last = [], None
            async for out in native.generate(req):
                toks.extend(out.new_token_ids)
                last = out
            return toks, last.usage

        lru = await session_sequence(direct, native.encode)
    finally:
        await native.stop()
    assert unicache == (0, 480)  # the session's 15 full prompt blocks all survive
    assert lru == (0, 288)  # vLLM's LRU evicted 6 of them (tail first) for the one-off prompts


async def test_usage_carries_vllms_own_queue_and_prefill_times(stack):
    """vLLM's request stats reach Usage: 12 concurrent prompts with max_num_seqs 8, so
    some wait for a slot; the phases vLLM measured fit in each request's own wall time."""
    async def timed(i: int):
        t0 = time.monotonic()
        _, usage = await generate(stack.replica, text(900 + i, 64), salt=b"phases", max_tokens=6)
        return usage, time.monotonic() - t0

    results = await asyncio.gather(*(timed(i) for i in range(12)))
    for usage, wall in results:
        assert usage.queue_time_s > 0 and usage.prefill_time_s > 0  # measured, not the 0.0 we used to send
        assert usage.queue_time_s + usage.prefill_time_s <= wall
