"""Per-tenant limits (router/request_path/limits.py): the limiter alone with a fake clock, its config,
and through the live router (gRPC + HTTP) against in-process fake replicas, checking the
status, the message, and that the tenant's counter returns to zero on every exit path."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.request_path.limits import LimitExceeded, TenantLimiter, TenantLimits, parse_tenant_limits
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

KEYS = "key-a:tenantA,key-b:tenantB"
PROMPT = "The quick brown fox jumps."  # 26 bytes: under tenantA's 40-token limit
A = [("x-api-key", "key-a")]
B = [("x-api-key", "key-b")]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------- the limiter
def test_concurrency_limit_counts_exactly_and_release_is_idempotent():
    lim = TenantLimiter(TenantLimits(max_concurrent=2), {"tenantB": {"max_concurrent": 1}})
    a1, a2 = lim.acquire("tenantA", 10), lim.acquire("tenantA", 10)
    with pytest.raises(LimitExceeded) as err:
        lim.acquire("tenantA", 10)
    assert (err.value.kind, err.value.limit) == ("overloaded", "max_concurrent")
    assert str(err.value) == (
        "tenant 'tenantA' already has 2 requests in flight (limit max_concurrent=2); retry when one finishes"
    )
    b1 = lim.acquire("tenantB", 10)  # another tenant's budget is separate
    with pytest.raises(LimitExceeded):
        lim.acquire("tenantB", 10)
    assert (lim.in_flight("tenantA"), lim.in_flight("tenantB")) == (2, 1)
    a1.release()
    a1.release()  # a second release changes nothing
    assert lim.in_flight("tenantA") == 1
    a3 = lim.acquire("tenantA", 10)
    for lease in (a2, a3, b1):
        lease.release()
    assert (lim.in_flight("tenantA"), lim.in_flight("tenantB")) == (0, 0)
    assert lim._state == {}  # idle tenants hold no state


def test_prompt_limit_and_override():
    lim = TenantLimiter(TenantLimits(max_prompt_tokens=100), {"big": {"max_prompt_tokens": 1000}})
    lim.check_prompt("small", 100)
    with pytest.raises(LimitExceeded) as err:
        lim.check_prompt("small", 101)
    assert (err.value.kind, err.value.limit) == ("invalid", "max_prompt_tokens")
    assert str(err.value) == "prompt has 101 tokens; tenant 'small' may send at most 100 (limit max_prompt_tokens)"
    lim.check_prompt("big", 1000)
    with pytest.raises(LimitExceeded):
        lim.acquire("small", 101)
    assert lim.in_flight("small") == 0  # a refusal counts nothing


def test_tokens_per_minute_window_expires_exactly():
    clock = FakeClock()
    lim = TenantLimiter(TenantLimits(tokens_per_minute=100), clock=clock)
    lim.acquire("t", 60).release()
    clock.t += 30
    lim.acquire("t", 40).release()  # 100 in the window: at the limit, admitted
    with pytest.raises(LimitExceeded) as err:
        lim.acquire("t", 1)
    assert (err.value.kind, err.value.limit) == ("overloaded", "tokens_per_minute")
    assert "sent 100 prompt tokens in the last 60 s (limit tokens_per_minute=100)" in str(err.value)
    clock.t += 30  # the 60-token grant is now 60 s old: out of the window
    lim.acquire("t", 60).release()
    with pytest.raises(LimitExceeded):
        lim.acquire("t", 1)
    with pytest.raises(LimitExceeded) as err:  # larger than a whole minute's budget: never admissible
        lim.acquire("t", 101)
    assert err.value.kind == "invalid"


def test_parse_overrides_both_forms_and_errors():
    assert parse_tenant_limits("") == {}
    assert parse_tenant_limits("acme.max_concurrent=4, acme.max_prompt_tokens=2048,b.c.tokens_per_minute=9") == {
        "acme": {"max_concurrent": 4, "max_prompt_tokens": 2048},
        "b.c": {"tokens_per_minute": 9},
    }
    assert parse_tenant_limits('{"acme": {"max_concurrent": 4}}') == {"acme": {"max_concurrent": 4}}
    for bad, msg in [
        ("acme=4", "expected tenant.limit=value"),
        ("acme.max_concurrent=four", "value must be an integer"),
        ("acme.max_speed=4", "unknown limit 'max_speed'"),
        ('{"acme": 4}', "expected {tenant: {limit: value}}"),
        ('{"acme": ', "bad JSON"),
    ]:
        with pytest.raises(UsageError, match=msg):
            parse_tenant_limits(bad)
    with pytest.raises(UsageError, match="max_concurrent must be a non-negative integer"):
        TenantLimiter(TenantLimits(), {"acme": {"max_concurrent": -1}})


def test_config_defaults_and_yaml_mapping(tmp_path):
    cfg = build_config(env={})
    assert (cfg.tenant_max_concurrent, cfg.tenant_max_prompt_tokens, cfg.tenant_tokens_per_minute) == (1024, -1, 0)
    f = tmp_path / "router.yaml"
    f.write_text("tenant_max_concurrent: 8\ntenant_limits:\n  acme: {max_concurrent: 2, tokens_per_minute: 500}\n")
    cfg = build_config(env={"UNICACHE_CONFIG": str(f)})
    assert cfg.tenant_max_concurrent == 8
    assert parse_tenant_limits(cfg.tenant_limits) == {"acme": {"max_concurrent": 2, "tokens_per_minute": 500}}


# ---------------------------------------------------------------- through the live router
def config(rep: FakeReplica, **overrides):
    env = {"UNICACHE_API_KEYS": KEYS, "UNICACHE_SALT_SECRET": "s3cret", "UNICACHE_USE_REDIS": "false"}
    base = {"grpc_port": 0, "http_port": 0, "replicas": f"solo={rep.address}", "routing_policy": "round_robin"}
    base.update(overrides)
    return build_config(env=env, overrides=base)


@pytest.fixture
async def limited():
    """Router with tenantA limited to 2 concurrent requests and 40-token prompts."""
    rep = FakeReplica("solo")
    await rep.start()
    app = RouterApp(config(rep, tenant_limits="tenantA.max_concurrent=2,tenantA.max_prompt_tokens=40"))
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        yield app, rep, router_pb2_grpc.RouterStub(channel), client
    finally:
        await client.aclose()
        await channel.close()
        await app.stop()
        await rep.stop()


def gen(stub, metadata, text: str = "hello", max_tokens: int = 3):
    req = router_pb2.RouterGenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    return stub.Generate(req, metadata=metadata, timeout=10)


async def read_rest(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def test_concurrency_limit_grpc_and_http_and_release_on_cancel(limited):
    app, rep, stub, client = limited
    lim = app.core.limits
    rep.hold = asyncio.Event()
    c1, c2 = gen(stub, A), gen(stub, A)
    await c1.read(), await c2.read()  # both streaming, held open by the replica
    assert lim.in_flight("tenantA") == 2

    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in gen(stub, A)]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == (
        "tenant 'tenantA' already has 2 requests in flight (limit max_concurrent=2); retry when one finishes"
    )
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": "key-a"})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "max_concurrent=2" in r.json()["error"]["message"] and "key-a" not in r.text
    assert len(rep.requests) == 2  # the refused requests never reached the replica

    # Another tenant is not limited by tenantA's budget.
    c3 = gen(stub, B)
    await c3.read()
    assert (lim.in_flight("tenantA"), lim.in_flight("tenantB")) == (2, 1)

    # Client cancel releases the slot.
    c1.cancel()
    await eventually(lambda: lim.in_flight("tenantA") == 1, "cancel to release")
    # Normal finish releases the slot.
    rep.hold.set()
    assert len(await read_rest(c2)) == 2
    assert (await read_rest(c3))[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    await eventually(lambda: lim.in_flight("tenantA") == 0 and lim.in_flight("tenantB") == 0, "finish to release")
    metrics = (await client.get("/metrics")).text
    assert 'unicache_router_limit_rejections_total{limit="max_concurrent"} 2.0' in metrics


async def test_prompt_too_long_is_invalid_argument_and_400(limited):
    app, rep, stub, client = limited
    long_prompt = "x" * 41  # byte tokenizer: 41 tokens
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in gen(stub, A, text=long_prompt)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt has 41 tokens; tenant 'tenantA' may send at most 40 (limit max_prompt_tokens)"
    body = {"messages": [{"role": "user", "content": "y" * 40}]}
    r = await client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].endswith("(limit max_prompt_tokens)")
    # tenantB has the default limit (32768): the same prompt is served.
    msgs = [m async for m in gen(stub, B, text=long_prompt)]
    assert msgs[-1].usage.prompt_tokens == 41
    assert [m async for m in gen(stub, A, text="x" * 40)][-1].usage.prompt_tokens == 40
    assert rep.requests[0].token_ids.ids == list(long_prompt.encode())
    assert len(rep.requests) == 2
    assert app.core.limits.in_flight("tenantA") == 0


async def test_release_on_replica_error_and_http_disconnects(limited):
    app, rep, stub, client = limited
    lim = app.core.limits
    # Replica error before the first token (not retryable): the client gets it, the slot is freed.
    rep.fail_next, rep.fail_code = 1, grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in gen(stub, A)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert lim.in_flight("tenantA") == 0
    # A plain HTTP request afterwards is served and frees its slot.
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": "key-a"})
    assert r.status_code == 200 and lim.in_flight("tenantA") == 0

    # HTTP streaming: the client leaves mid-stream.
    rep.hold = asyncio.Event()
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-api-key": "key-a"}) as r:
        async for line in r.aiter_lines():
            if line:
                assert json.loads(line[6:])["choices"][0]["text"] == "T"
                assert lim.in_flight("tenantA") == 1
                break
    await eventually(lambda: lim.in_flight("tenantA") == 0, "stream disconnect to release")

    # HTTP non-streaming: the client gives up while the replica holds the request.
    n = len(rep.requests)
    post = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, headers={"x-api-key": "key-a"}))
    await eventually(lambda: len(rep.requests) == n + 1, "request at the replica")
    assert lim.in_flight("tenantA") == 1
    post.cancel()
    with pytest.raises(asyncio.CancelledError):
        await post
    await eventually(lambda: lim.in_flight("tenantA") == 0, "disconnect to release")

    # With no replica at all: 503 and nothing held.
    app.cluster.remove("solo")
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": "key-a"})
    assert r.status_code == 503 and lim.in_flight("tenantA") == 0
    assert lim._state == {}


async def test_bad_tenant_limits_refuse_to_start():
    rep = FakeReplica("solo")
    with pytest.raises(UsageError, match="unknown limit 'max_rps'"):
        RouterApp(config(rep, tenant_limits="tenantA.max_rps=3"))
