"""Router building blocks without servers: config precedence, auth and salts, chat
template, status table, CLI wiring."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import json

import pytest

from unicache.cli.main import main
from unicache.contract.chat_template import BYTE_CHAT_TEMPLATE, ChatFormatError, render_chat
from unicache.plumbing.errors import UsageError
from unicache.router.cluster.view import ReplicaRecord
from unicache.router.config import RouterConfig, add_config_arguments, build_config
from unicache.router.frontends.chat_template import render_chat_json
from unicache.router.observability.status import format_table
from unicache.router.request_path.auth import AuthError, Authenticator, api_key_from_headers, load_api_keys_file, parse_api_keys
from unicache.router.request_path.core import Labelled, Prepared
from unicache.router.upstream.replica_client import parse_replica_message
from unicache.v1 import common_pb2, replica_pb2, router_pb2


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return p.parse_args(argv)


def test_config_precedence_file_env_flag(tmp_path):
    f = tmp_path / "router.yaml"
    f.write_text("grpc-port: 6000\nhttp_port: 6001\nrouting_policy: sglang\nauth_enabled: false\n")
    env = {"UNICACHE_CONFIG": str(f), "UNICACHE_HTTP_PORT": "7001", "UNICACHE_FORWARD_DEADLINE_S": "2.5"}
    cfg = build_config(parse(["--http-port", "8001", "--use-redis", "no"]), env=env)
    assert (cfg.grpc_port, cfg.http_port, cfg.routing_policy, cfg.auth_enabled) == (6000, 8001, "sglang", False)
    assert (cfg.forward_deadline_s, cfg.use_redis, cfg.block_size) == (2.5, False, 16)
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"block_size": 4}))
    assert build_config(parse(["--config", str(j)]), env={}).block_size == 4


def test_config_errors_are_usage_errors_without_secrets(tmp_path):
    with pytest.raises(UsageError, match="UNICACHE_GRPC_PORT: grpc_port must be int"):
        build_config(env={"UNICACHE_GRPC_PORT": "lots"})
    with pytest.raises(UsageError, match="unknown setting 'colour'"):
        (tmp_path / "c.yaml").write_text("colour: red\n")
        build_config(env={"UNICACHE_CONFIG": str(tmp_path / "c.yaml")})
    with pytest.raises(UsageError, match="bad --replicas entry"):
        RouterConfig(replicas="a=1:2,b").static_replicas()
    assert RouterConfig(replicas="a=h:1, b=h:2@h:3").static_replicas() == {"a": ("h:1", ""), "b": ("h:2", "h:3")}
    with pytest.raises(UsageError, match="bad --replicas entry"):
        RouterConfig(replicas="a=h:1@").static_replicas()
    shown = RouterConfig(salt_secret="topsecret", api_keys="k:t").describe()
    assert shown["salt_secret"] == "***" and shown["api_keys"] == "***" and shown["redis_password"] == ""
    assert "topsecret" not in json.dumps(shown)


TLS_TRIO = ("replica_tls_ca", "replica_tls_cert", "replica_tls_key")


def test_every_setting_has_flag_and_env(tmp_path):
    from unicache.plumbing.settings import SECRET_FILE_FIELDS

    secret_file = tmp_path / "secret"
    secret_file.write_text("secret-from-file-0123456789\n")
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    flags = {a.dest for a in p._actions}
    for f in dataclasses.fields(RouterConfig):
        assert f"cfg_{f.name}" in flags
        if f.name in SECRET_FILE_FIELDS:  # a path that must exist; it fills its secret
            cfg = build_config(env={f"UNICACHE_{f.name.upper()}": str(secret_file)})
            assert getattr(cfg, f.name) == str(secret_file)
            assert getattr(cfg, f.name[: -len("_file")]) == "secret-from-file-0123456789"
            continue
        valid = {"routing_policy": "sglang", "http_parser": "h11", "event_loop": "asyncio", "memory_budget_mib": "128",
                 "shared_sessions": "on", "replica_transport": "grpc", "backends": "http://h:1,id=v",
                 "backend_discovery": "dns://vllm:8000?kv-events=5557", "redis_url": "rediss://h:1/0",
                 "routing_options": "prefill_lanes=2", "kv_events_listen": "tcp://*:5557"}  # checked names
        value = valid.get(f.name) or {"str": "v", "int": "3", "float": "1.5", "bool": "true"}[f.type]
        env = {f"UNICACHE_{f.name.upper()}": value}
        if f.name in TLS_TRIO:  # one needs the other two
            env = {f"UNICACHE_{name.upper()}": value for name in TLS_TRIO}
        if f.name == "redis_tls_ca":  # a CA needs a rediss:// URL
            env["UNICACHE_REDIS_URL"] = "rediss://h:1/0"
        cfg = build_config(env=env)
        assert str(getattr(cfg, f.name)) in (value, "True")


def test_router_config_validates_itself_and_decides_redis():
    """The checks RouterApp made while wiring are the config's: ``validate`` (which
    build_config calls) and ``follows_redis``, with the same messages."""
    with pytest.raises(UsageError, match="^redis_url must start with redis://, rediss:// or unix://$"):
        RouterConfig(redis_url="http://h:1/0").validate()
    with pytest.raises(UsageError, match="^redis_tls_ca needs a rediss:// redis_url$"):
        build_config(overrides={"redis_url": "redis://h:1/0", "redis_tls_ca": "/ca.pem"})
    RouterConfig(use_redis=False, redis_url="http://h:1/0").validate()  # not followed: not checked
    assert RouterConfig(use_redis=False).follows_redis() is False
    with pytest.raises(UsageError, match="^following replicas through Redis needs the cluster key"):
        RouterConfig().follows_redis()
    assert RouterConfig(backends="http://h:1,id=v").follows_redis() is False  # vLLM backends only
    assert RouterConfig(cluster_key="00" * 32).follows_redis() is True


def test_auth_keys_tenants_and_salts(tmp_path):
    keys = parse_api_keys("k1:tenantA, k2:tenantB\n# comment\nk:with:colon:tenantC")
    assert keys == {"k1": "tenantA", "k2": "tenantB", "k:with:colon": "tenantC"}
    with pytest.raises(UsageError, match="entry 1"):
        parse_api_keys("nokey")
    (tmp_path / "keys.json").write_text('{"j1": "tA"}')
    assert load_api_keys_file(str(tmp_path / "keys.json")) == {"j1": "tA"}
    auth = Authenticator(keys, "secret")
    assert auth.authenticate("k2") == "tenantB"
    for bad in (None, "", "k", "k1 ", "K1"):
        with pytest.raises(AuthError) as err:
            auth.authenticate(bad)
        assert "k1" not in str(err.value)
    expected = hmac.new(b"secret", b"tenantA", hashlib.sha256).digest()[:16]
    assert auth.cache_salt("tenantA") == expected
    assert auth.cache_salt("tenantB") != expected
    assert Authenticator(keys, "other").cache_salt("tenantA") != expected
    assert Authenticator({}, "", enabled=False).authenticate(None) == "default"
    with pytest.raises(UsageError, match="SALT_SECRET"):
        Authenticator(keys, "")
    with pytest.raises(UsageError, match="no API keys"):
        Authenticator({}, "s")


def test_api_key_from_headers():
    assert api_key_from_headers({"authorization": "Bearer abc"}.get) == "abc"
    assert api_key_from_headers({"authorization": "bearer  abc "}.get) == "abc"
    assert api_key_from_headers({"x-api-key": "xyz"}.get) == "xyz"
    assert api_key_from_headers({"authorization": "Basic Zm9v", "x-api-key": "xyz"}.get) == "xyz"
    assert api_key_from_headers({}.get) is None


def test_chat_template():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    text = render_chat(msgs, BYTE_CHAT_TEMPLATE)
    assert text == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\nA\n<|assistant|>\n"
    # The next turn's rendering starts with this turn's prompt (minus its generation cue).
    longer = render_chat(msgs + [{"role": "user", "content": "again"}], BYTE_CHAT_TEMPLATE)
    assert longer.startswith(text[: -len("<|assistant|>\n")])
    assert render_chat_json(json.dumps(msgs), BYTE_CHAT_TEMPLATE) == text
    for bad in ([], [{"role": "x", "content": "a"}], ["hi"], [{"role": "user", "content": [{"type": "image"}]}]):
        with pytest.raises(ChatFormatError):
            render_chat(bad, BYTE_CHAT_TEMPLATE)
    with pytest.raises(ChatFormatError, match="not valid JSON"):
        render_chat_json("[{", BYTE_CHAT_TEMPLATE)


def test_status_table_exact():
    state = router_pb2.ClusterState(redis_connected=True, routing_policy="cache_aware")
    rs = state.replicas.add()
    rs.info.replica_id, rs.info.address, rs.info.healthy, rs.info.device = "r0", "10.0.0.1:50052", True, "cuda:0"
    rs.info.hop_address = "10.0.0.1:50053"
    rs.running, rs.waiting, rs.indexed_blocks = 3, 1, 120
    rs.cache.CopyFrom(
        common_pb2.CacheState(capacity_blocks=1000, used_blocks=200, free_blocks=800, cached_blocks=150, hit_ratio=0.4567, evictions=9, queue_sizes={"evict_first": 5, "chat": 7})
    )
    r1 = state.replicas.add()
    r1.info.replica_id, r1.info.address, r1.info.healthy, r1.info.device = "r1", "10.0.0.2:50052", True, "cuda:0"
    r1.cache.CopyFrom(common_pb2.CacheState(capacity_blocks=10, host=common_pb2.HostTierState(
        capacity_blocks=40, used_blocks=12, hit_ratio=0.125, promotions=30, demotions=52)))
    lines = format_table(state).splitlines()
    assert lines[0] == "routing policy: cache_aware   redis: connected   replicas: 2"
    assert lines[1].split() == ["replica", "address", "hop", "device", "health", "run", "wait", "capacity", "used", "free", "cached", "hit%", "evict", "host", "indexed", "queues"]
    assert lines[2].split() == ["r0", "10.0.0.1:50052", "10.0.0.1:50053", "cuda:0", "ok", "3", "1", "1000", "200", "800", "150", "45.7", "9", "-", "120", "chat=7", "evict_first=5"]
    assert lines[3].split() == ["r1", "10.0.0.2:50052", "-", "cuda:0", "ok", "0", "0", "10", "0", "0", "0", "0.0", "0", "12/40", "12.5%", "p30", "d52", "0", "-"]


def test_hot_path_records_use_slots():
    for cls in (Prepared, Labelled, ReplicaRecord):
        assert "__slots__" in vars(cls), cls


def test_replica_response_fields_are_the_router_responses_first_fields():
    """The router reads a replica's GenerateResponse bytes as a RouterGenerateResponse
    (``parse_replica_message``): that is a field-by-field copy only while every replica
    field has the same number, name and type there, and none lands on a router-only field
    such as ``route``."""
    def shape(msg) -> dict:
        return {
            f.number: (f.name, f.type, f.is_repeated, (f.message_type or f.enum_type) and (f.message_type or f.enum_type).full_name)
            for f in msg.DESCRIPTOR.fields
        }

    replica, router = shape(replica_pb2.GenerateResponse), shape(router_pb2.RouterGenerateResponse)
    assert {n: router[n] for n in replica} == replica
    assert set(router) - set(replica) == {router_pb2.RouterGenerateResponse.DESCRIPTOR.fields_by_name["route"].number}


def test_replica_messages_are_read_with_every_field():
    usage = common_pb2.Usage(prompt_tokens=20, cached_tokens=16, completion_tokens=3)
    lp = common_pb2.TokenLogprobs(logprob=-0.5, top=[common_pb2.TopLogprob(token_id=7, logprob=-0.5)])
    msg = replica_pb2.GenerateResponse(index=1, token_ids=[7, 300], text="hé", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage,
                                       logprobs=[lp, lp])
    assert parse_replica_message(msg.SerializeToString()) == router_pb2.RouterGenerateResponse(
        index=1, token_ids=[7, 300], text="hé", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage, logprobs=[lp, lp]
    )
    got = parse_replica_message(replica_pb2.GenerateResponse(token_ids=[5]).SerializeToString())
    assert got == router_pb2.RouterGenerateResponse(token_ids=[5]) and not got.HasField("route")


def test_cli_status_unreachable_is_one_line(capsys):
    assert main(["status", "--router", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["unicache status: error: router 127.0.0.1:1 unreachable: UNAVAILABLE"]


def test_redis_url_password_masked_in_describe():
    shown = RouterConfig(redis_url="rediss://app:pa55@redis:6380/0").describe()
    assert shown["redis_url"] == "rediss://app:***@redis:6380/0"
    assert RouterConfig(redis_url="redis://h:1/0").describe()["redis_url"] == "redis://h:1/0"


def test_router_tokenizes_like_the_replicas(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from unicache.replica.engines.builtin.config import EngineConfig
    from unicache.contract.tokenizer import load_tokenizer
    from unicache.router.app import RouterApp

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    base = {"use_redis": False, "auth_enabled": False}
    router_tok = RouterApp(build_config(env={"UNICACHE_CHECKPOINT": str(ckpt)}, overrides=base)).core.tokenizer
    replica_tok = load_tokenizer(EngineConfig(checkpoint=str(ckpt)).tokenizer_path())
    assert router_tok.encode("hello world zzz") == replica_tok.encode("hello world zzz") == [0, 1, 2]
    # Explicit 'byte' wins; a checkpoint without tokenizer.json means bytes, as on replicas.
    assert RouterApp(build_config(env={}, overrides={**base, "checkpoint": str(ckpt), "tokenizer": "byte"})).core.encode("hi") == [104, 105]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert RouterApp(build_config(env={}, overrides={**base, "checkpoint": str(empty)})).core.encode("hi") == [104, 105]
    with pytest.raises(UsageError, match="not readable from the router"):
        RouterApp(build_config(env={}, overrides={**base, "checkpoint": str(tmp_path / "missing")}))
    with pytest.raises(UsageError, match="cannot load tokenizer"):
        RouterApp(build_config(env={}, overrides={**base, "tokenizer": str(tmp_path / "nope.json")}))


def test_metrics_per_replica_gauges_follow_membership():
    from unicache.router.cluster.view import ClusterView
    from unicache.router.cluster.index import LocalityIndex
    from unicache.router.observability.metrics import RouterMetrics
    from unicache.router.routing.registry import make_routing_policy
    from unicache.v1 import cache_pb2

    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    hb = cache_pb2.Heartbeat(replica_id="a", running=2, waiting=3, cache=common_pb2.CacheState(used_blocks=7, free_blocks=93, hit_ratio=0.25))
    cluster.upsert("a", "h:1", hb)
    cluster.upsert("b", "h:2")
    cluster.index.apply_summary("a", 1, 0, [b"x" * 16, b"y" * 16])
    m = RouterMetrics()
    text = m.render(cluster).decode()
    for line in [
        'unicache_router_replica_used_blocks{replica="a"} 7.0',
        'unicache_router_replica_free_blocks{replica="a"} 93.0',
        'unicache_router_replica_hit_ratio{replica="a"} 0.25',
        'unicache_router_replica_load{replica="a"} 5.0',
        'unicache_router_replica_load{replica="b"} 0.0',
        'unicache_router_indexed_blocks{replica="a"} 2.0',
        "unicache_router_replicas 2.0",
        "unicache_router_redis_connected 0.0",
    ]:
        assert line in text, line
    assert "unicache_router_replica_queue_share{" not in text  # round_robin keeps no queue share
    cluster.remove("a")
    text = m.render(cluster).decode()
    assert 'replica="a"' not in text and 'unicache_router_replica_load{replica="b"} 0.0' in text


def test_metrics_show_cache_awares_queue_share_per_replica():
    from unicache.router.cluster.view import ClusterView
    from unicache.router.cluster.index import LocalityIndex
    from unicache.router.observability.metrics import RouterMetrics
    from unicache.router.routing.base import RouteDecision, RoutingRequest
    from unicache.contract.block_hash import hash_id_blocks
    from unicache.contract.request_class import RequestClass
    from unicache.router.routing.cache_aware.policy import CacheAwarePolicy

    policy = CacheAwarePolicy()
    cluster = ClusterView(policy, LocalityIndex())
    cluster.upsert("a", "h:1")
    cluster.upsert("b", "h:2")
    hs = hash_id_blocks([1, 2, 3, 4])
    policy.on_request_routed(RoutingRequest("q", RequestClass(), hs, 64, 16), RouteDecision("a", "index_prefix", 3))
    text = RouterMetrics().render(cluster).decode()
    assert 'unicache_router_replica_queue_share{replica="a"} 0.25' in text  # 16 of 64 tokens uncached
    assert 'unicache_router_replica_queue_share{replica="b"} 1.0' in text


async def test_completion_prompts_get_the_tokenizers_bos_and_chat_templates_do_not(tmp_path):
    # vLLM's rule: a completion prompt is tokenized with the tokenizer's special tokens (a
    # Llama tokenizer.json's post-processor prepends BOS); a rendered chat template carries
    # its own and is tokenized without; token-id prompts are taken as given.
    import httpx
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from unicache.router.app import RouterApp
    from unicache.contract.tokenizer import ByteTokenizer, HFTokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(ckpt / "tokenizer.json"))
    hf = HFTokenizer(str(ckpt))
    assert (hf.encode("hello world"), hf.encode("hello world", add_special_tokens=True)) == ([2, 3], [0, 2, 3])
    assert hf.encode("<s> hello") == [0, 2]  # special tokens in the text are recognised either way
    assert ByteTokenizer().encode("hi", add_special_tokens=True) == [104, 105]  # no post-processor

    app = RouterApp(build_config(env={"UNICACHE_CHECKPOINT": str(ckpt)}, overrides={"use_redis": False, "auth_enabled": False, "grpc_port": 0, "http_port": 0}))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as c:
            body = {"model": app.config.served_model_name, "max_tokens": 0, "echo": True}
            got = []
            for prompt in ("hello world", [2, 3]):
                r = await c.post("/v1/completions", json={**body, "prompt": prompt})
                assert r.status_code == 200, r.text
                got.append(r.json()["usage"]["prompt_tokens"])
            assert got == [3, 2]
            # streamed, the same events as a generated stream: usage null on each choice, then the usage
            r = await c.post("/v1/completions", json={**body, "prompt": ["hello world", [2]], "stream": True,
                                                        "stream_options": {"include_usage": True}})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.text.split("\n") if line]
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert [(e["choices"], e["usage"]) for e in events[:2]] == [
                ([{"index": 0, "text": "hello world", "finish_reason": "length", "logprobs": None}], None),
                ([{"index": 1, "text": hf.decode([2]), "finish_reason": "length", "logprobs": None}], None)]
            assert events[2]["choices"] == [] and events[2]["usage"]["prompt_tokens"] == 4
            assert {e["object"] for e in events} == {"text_completion"} and len({e["id"] for e in events}) == 1
    finally:
        await app.stop()
    assert app.core.encode("hello world", add_special_tokens=True) == [0, 2, 3]


def _msg(**kw) -> router_pb2.RouterGenerateResponse:
    return router_pb2.RouterGenerateResponse(**kw)


def test_queued_messages_of_one_sample_are_handed_on_as_one():
    from collections import deque

    from unicache.router.upstream.replica_stream import take_queued

    lp = [common_pb2.TokenLogprobs(logprob=-float(i)) for i in range(4)]
    usage = common_pb2.Usage(prompt_tokens=9, completion_tokens=4)
    items = deque([
        _msg(token_ids=[1], text="a", logprobs=[lp[0]]),
        _msg(token_ids=[2, 3], text="bc", logprobs=lp[1:3]),
        _msg(token_ids=[], text=""),  # a message with nothing new (held-back text) merges to nothing
        _msg(token_ids=[4], text="d", logprobs=[lp[3]], finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage),
        _msg(index=1, token_ids=[5], text="e"),
    ])
    assert take_queued(items) == _msg(token_ids=[1, 2, 3, 4], text="abcd", logprobs=lp,
                                      finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage)
    assert list(items) == [_msg(index=1, token_ids=[5], text="e")]  # another sample's message stays
    assert take_queued(items) == _msg(index=1, token_ids=[5], text="e") and not items


def test_take_queued_stops_at_a_sample_change_and_after_an_end():
    from collections import deque

    from unicache.router.upstream.replica_stream import take_queued

    items = deque([_msg(index=0, token_ids=[1]), _msg(index=1, token_ids=[2]), _msg(index=0, token_ids=[3])])
    assert take_queued(items) == _msg(index=0, token_ids=[1]) and len(items) == 2  # interleaved samples stay apart
    ended = deque([_msg(token_ids=[1], finish_reason=common_pb2.FINISH_REASON_LENGTH), _msg(token_ids=[2])])
    assert take_queued(ended) == _msg(token_ids=[1], finish_reason=common_pb2.FINISH_REASON_LENGTH) and len(ended) == 1
    used = deque([_msg(token_ids=[1], usage=common_pb2.Usage(completion_tokens=1)), _msg(token_ids=[2])])
    assert take_queued(used).token_ids == [1] and len(used) == 1


def test_take_queued_knows_every_field_a_replica_sends():
    """A field added to GenerateResponse must be merged by ``take_queued`` too: this lists
    the ones it handles (``route`` is the router's own)."""
    handled = {"index", "token_ids", "text", "finish_reason", "usage", "logprobs"}
    assert {f.name for f in replica_pb2.GenerateResponse.DESCRIPTOR.fields} == handled


async def test_a_hop_stream_reads_what_arrived_before_it_asked_as_one_message():
    from unicache.router.upstream.hop_client import HopStream

    stream = HopStream(None, b"", deadline=0.0)  # ended below, so it never connects
    for i, t in enumerate("abc"):
        stream._push(_msg(token_ids=[i], text=t))
    stream._finish(None)
    assert await stream.next() == _msg(token_ids=[0, 1, 2], text="abc")
    assert await stream.next() is None
