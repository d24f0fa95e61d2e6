"""The router end to end over gRPC and HTTP against in-process replicas (unicache/testing/fake_replica.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import httpx
import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.routing.registry import make_routing_policy
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.router_stack import config, single_replica_router

PROMPT = "The quick brown fox jumps over the lazy dog, twice."  # 51 bytes = 3 full blocks


@contextlib.asynccontextmanager
async def fake_cluster(n: int):
    """A router (round robin, static replicas) in front of ``n`` fake replicas r0..r{n-1}."""
    reps = [FakeReplica(f"r{i}") for i in range(n)]
    for r in reps:
        await r.start()
    app = RouterApp(config(reps))
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    try:
        yield app, reps, router_pb2_grpc.RouterStub(channel)
    finally:
        await channel.close()
        await app.stop()
        for r in reps:
            await r.stop()


@pytest.fixture
async def cluster2():
    async with fake_cluster(2) as stack:
        yield stack


async def collect(call):
    return [m async for m in call]


async def test_grpc_generate_routes_authenticates_and_salts(cluster2):
    app, (r0, r1), stub = cluster2
    call = stub.Generate(
        router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=3), session_id="s1", task="chat"),
        metadata=[("authorization", "Bearer key-a")],
        timeout=10,
    )
    msgs = await collect(call)
    assert [list(m.token_ids) for m in msgs] == [[ord("T")], [ord("h")], [ord("e")]]
    route = msgs[0].route
    assert (route.replica_id, route.reason) == ("r0", "round_robin")
    assert route.request_class.tenant == "tenantA"
    assert route.request_class.session_id == "s1"
    assert route.request_class.task == "chat"
    assert not msgs[1].HasField("route")
    assert msgs[-1].usage.prompt_tokens == len(PROMPT)
    # The replica got token ids, the tenant's salt and the class.
    (req,) = r0.requests
    assert list(req.token_ids.ids) == list(PROMPT.encode())
    assert req.cache_salt == app.auth.cache_salt("tenantA")
    assert req.request_class.tenant == "tenantA" and req.request_class.session_id == "s1"
    assert r1.requests == []
    # x-api-key works too, and round robin moves on to r1.
    msgs = await collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=[("x-api-key", "key-b")], timeout=10))
    assert msgs[0].route.replica_id == "r1"
    assert r1.requests[0].cache_salt == app.auth.cache_salt("tenantB") != app.auth.cache_salt("tenantA")


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("x-api-key", "key-a-")]])
async def test_grpc_rejects_missing_or_wrong_key(cluster2, metadata):
    _, (r0, r1), stub = cluster2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=metadata, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "key-a" not in (err.value.details() or "")
    assert r0.requests == [] and r1.requests == []


@pytest.fixture
async def cluster3():
    async with fake_cluster(3) as stack:
        yield stack


def served(reps: list[FakeReplica]) -> list[int]:
    return [len(r.served) for r in reps]


async def test_grpc_retries_on_distinct_replicas_then_quarantines_and_probes_back(cluster3):
    app, reps, stub = cluster3
    r0, r1, r2 = reps
    now = [100.0]
    app.cluster.clock = lambda: now[0]
    gen = lambda: collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=[("x-api-key", "key-a")], timeout=10))  # noqa: E731
    r0.fail_next = r2.fail_next = 1
    msgs = await gen()
    # Two refusals (UNAVAILABLE), two retries, each on a replica not tried before
    # (round robin: r0, then r2 of {r1, r2}, then r1).
    assert msgs[0].route.replica_id == "r1"
    assert served(reps) == [1, 1, 1]
    assert app.metrics.registry.get_sample_value("unicache_router_retries_total") == 2
    assert {r: rec.in_flight for r, rec in app.cluster.replicas.items()} == {"r0": 0, "r1": 0, "r2": 0}
    # Both refusers are quarantined at once: routing offers only r2 until they answer a probe.
    lst = await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
    assert [(r.replica_id, r.healthy) for r in lst.replicas] == [("r0", False), ("r1", True), ("r2", False)]
    assert [(await gen())[0].route.replica_id for _ in range(2)] == ["r1", "r1"]
    assert served(reps) == [1, 3, 1]
    assert [app.metrics.registry.get_sample_value("unicache_router_quarantines_total", {"replica": r}) for r in ("r0", "r2")] == [1, 1]
    now[0] += app.cluster.quarantine_initial_s  # the first probe is due: both answer it
    await eventually(lambda: app.cluster.healthy("r0") and app.cluster.healthy("r2"), "quarantined replicas probed back", 10)
    # Every replica fails: three attempts (1 + retry_replicas), then the last error, naming no address.
    for r in reps:
        r.fail_next = 1
    before = served(reps)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gen()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "replica unavailable"
    assert [a - b for a, b in zip(served(reps), before)] == [1, 1, 1]
    assert app.metrics.registry.get_sample_value("unicache_router_retries_total") == 4


async def test_retry_replicas_bounds_the_attempts_that_cost_work_and_refusals_do_not_count(cluster3):
    app, reps, stub = cluster3
    app.core.retry_replicas = 1
    for r in reps:
        r.fail_next, r.fail_code = 1, grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=[("x-api-key", "key-a")], timeout=10))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, "replica failed")
    assert served(reps) == [1, 0, 1]  # round robin: r0, then r2 of {r1, r2}; no third attempt
    assert all(app.cluster.healthy(r.replica_id) for r in reps)  # errors, not refusals: nobody quarantined
    # A refusal costs no retry: r2 refuses (UNAVAILABLE), r1 fails (its INTERNAL is still
    # pending), r0 serves: round robin's next is 2, so r2, then r1 of {r0, r1}, then r0;
    # retry_replicas = 1 allows the one failure that cost work.
    reps[2].fail_next, reps[2].fail_code = 1, grpc.StatusCode.UNAVAILABLE
    msgs = await collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=[("x-api-key", "key-a")], timeout=10))
    assert msgs[0].route.replica_id == "r0"
    assert served(reps) == [2, 1, 2]
    assert [app.cluster.healthy(r.replica_id) for r in reps] == [True, True, False]


async def test_grpc_invalid_argument_is_not_retried(cluster2):
    _, (r0, r1), stub = cluster2
    r0.fail_next, r0.fail_code = 1, grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), metadata=[("x-api-key", "key-a")], timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (len(r0.requests), len(r1.requests)) == (1, 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(router_pb2.RouterGenerateRequest(), metadata=[("x-api-key", "key-a")], timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_client_cancel_propagates_to_replica(cluster2):
    app, (r0, _), stub = cluster2
    r0.hold = asyncio.Event()
    call = stub.Generate(
        router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=5)),
        metadata=[("x-api-key", "key-a")],
        timeout=10,
    )
    first = await call.read()
    assert first.route.replica_id == "r0"
    call.cancel()
    await asyncio.wait_for(r0.cancelled.wait(), 10)
    for _ in range(200):  # the router's handler unwinds asynchronously
        if app.cluster.replicas["r0"].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert app.cluster.replicas["r0"].in_flight == 0


async def test_the_policy_hears_a_first_token_while_the_stream_goes_on():
    """The router tells the policy of a request's first token (cache_aware then stops
    counting it in the replica's queue share) while the rest still streams."""
    rep = FakeReplica("r0")
    await rep.start()
    app = RouterApp(config([rep], routing_policy="cache_aware"))
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    policy, seen = app.policy, []
    first_token = policy.on_first_token

    def record(request, replica_id):
        seen.append((replica_id, {rid: list(t) for rid, t in policy._queues.own.items()}))
        first_token(request, replica_id)

    policy.on_first_token = record
    try:
        rep.hold = asyncio.Event()
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=3)),
            metadata=[("x-api-key", "key-a")], timeout=10)
        first = await call.read()
        # nothing was cached: all 51 prompt tokens of the request were queued uncached
        assert first.route.replica_id == "r0" and seen == [("r0", {"r0": [len(PROMPT), len(PROMPT)]})]
        assert policy._queues.requests == {} and app.cluster.replicas["r0"].in_flight == 1
        rep.hold.set()
        rest = [await call.read(), await call.read()]
        assert [m.finish_reason for m in rest][-1] == common_pb2.FINISH_REASON_LENGTH and len(seen) == 1
    finally:
        await channel.close()
        await app.stop()
        await rep.stop()


async def test_grpc_cluster_state_and_list_replicas(cluster2):
    _, (r0, _), stub = cluster2
    lst = await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
    assert [(r.replica_id, r.healthy) for r in lst.replicas] == [("r0", True), ("r1", True)]
    r0.cached.add(b"z" * 16)
    state = await stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=5)
    assert [s.info.replica_id for s in state.replicas] == ["r0", "r1"]
    # Static replicas have no heartbeat: their cache state comes from GetCacheState.
    assert [(s.cache.replica_id, s.cache.block_size, s.cache.cached_blocks) for s in state.replicas] == [("r0", 16, 1), ("r1", 16, 0)]
    assert state.routing_policy == "round_robin" and state.redis_connected is False


@pytest.fixture
async def single():
    async with single_replica_router(routing_policy="cache_aware") as stack:
        yield stack


async def test_http_completion_reports_cached_tokens_and_route_headers(single):
    app, rep, client = single
    body = {"model": "unicache-default", "prompt": PROMPT, "max_tokens": 2}
    r = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200, r.text
    assert r.headers["x-unicache-replica"] == "solo"
    assert r.headers["x-unicache-route-reason"]
    out = r.json()
    assert out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": "Th", "finish_reason": "length", "logprobs": None}]
    assert out["usage"] == {"prompt_tokens": 51, "completion_tokens": 2, "total_tokens": 53, "prompt_tokens_details": {"cached_tokens": 0}}
    r = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    # Another tenant, same prompt: different salt, nothing shared.
    r = await client.post("/v1/completions", json=body, headers={"x-api-key": "key-b"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    salts = [req.cache_salt for req in rep.requests]
    assert salts[0] == salts[1] != salts[2]


async def test_http_streaming_completion_and_chat(single):
    app, rep, client = single
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-api-key": "key-a"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-unicache-replica"] == "solo"
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [e["choices"][0]["text"] for e in events[:3]] == ["T", "h", "e"]
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "length"]
    assert events[3]["choices"] == [] and events[3]["usage"]["prompt_tokens"] == 51

    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=chat, headers={"x-api-key": "key-a", "x-session-id": "conv-7"}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"content": "<", "role": "assistant"}
    assert events[1]["choices"][0]["delta"] == {"content": "|"}
    assert bytes(rep.requests[-1].token_ids.ids).decode() == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert rep.requests[-1].request_class.session_id == "conv-7"


async def test_http_chat_non_streaming(single):
    _, _, client = single
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}], "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "key-a"})
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "<|"}, "logprobs": None, "finish_reason": "length"}]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status"),
    [
        ("/v1/completions", {"prompt": "x"}, {}, 401),
        ("/v1/completions", {"prompt": "x"}, {"authorization": "Bearer nope"}, 401),
        ("/v1/completions", {"prompt": 5}, {"x-api-key": "key-a"}, 400),
        ("/v1/completions", {"prompt": [1, 259]}, {"x-api-key": "key-a"}, 400),
        ("/v1/completions", {"prompt": ""}, {"x-api-key": "key-a"}, 400),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, {"x-api-key": "key-a"}, 400),
        ("/v1/completions", {"prompt": "x", "task": "poetry"}, {"x-api-key": "key-a"}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {"x-api-key": "key-a"}, 400),
        ("/v1/chat/completions", {"messages": []}, {"x-api-key": "key-a"}, 400),
    ],
)
async def test_http_errors_are_openai_json(single, path, body, headers, status):
    _, rep, client = single
    r = await client.post(path, json=body, headers=headers)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "key-a" not in r.text
    assert rep.requests == []


async def test_http_bad_json_overload_and_no_replicas():
    rep = FakeReplica("solo")
    await rep.start()
    app = RouterApp(config([rep], max_in_flight=0))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as c:
            r = await c.post("/v1/completions", content=b"{nope", headers={"x-api-key": "key-a"})
            assert r.status_code == 400
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"x-api-key": "key-a"})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            app.core.max_in_flight = 10
            app.cluster.remove("solo")
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"x-api-key": "key-a"})
            assert r.status_code == 503
            assert (await c.get("/readyz")).status_code == 503
    finally:
        await app.stop()
        await rep.stop()


async def test_http_models_health_metrics_state_dashboard(single):
    app, _, client = single
    assert (await client.get("/v1/models")).status_code == 401
    r = await client.get("/v1/models", headers={"x-api-key": "key-a"})
    assert r.json()["data"][0]["id"] == "unicache-default"
    assert (await client.get("/healthz")).json() == {"status": "ok", "replicas": 1, "redis_connected": False}
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"x-api-key": "key-a"})
    text = (await client.get("/metrics")).text
    assert 'unicache_router_requests_total{api="completions",outcome="ok"} 1.0' in text
    assert 'unicache_router_computed_tokens_total{replica="solo"} 51.0' in text
    assert "unicache_router_routing_latency_seconds_count 1.0" in text
    assert 'unicache_router_replica_load{replica="solo"} 0.0' in text
    assert "unicache_router_ttft_seconds_count 1.0" in text
    assert "s3cret" not in text and "key-a" not in text
    assert 'unicache_router_ttft_prediction_error_seconds_count{replica="solo"} 1.0' in text
    assert 'unicache_router_backend_cost_fitted{replica="solo"} 0.0' in text
    state = (await client.get("/v1/cluster/state")).json()
    assert [r["info"]["replica_id"] for r in state["replicas"]] == ["solo"]
    assert state["routing_policy"] == "cache_aware"
    costs = state["replicas"][0]["costs"]  # one request: the prior, its prediction scored
    assert (costs["fitted"], costs["predictions"], costs["prefill_per_token_s"]) == (False, "1", 2.0 ** -13)
    assert (await client.get("/v1/cluster/costs")).json() == {"version": 1, "backends": {}}
    html = (await client.get("/dashboard")).text
    assert "/v1/cluster/state" in html and "setInterval" in html


async def test_auth_disabled_local_mode_uses_default_tenant():
    rep = FakeReplica("solo")
    await rep.start()
    app = RouterApp(config([rep], auth_enabled=False))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            assert r.status_code == 200
        assert rep.requests[0].request_class.tenant == "default"
        assert rep.requests[0].cache_salt == app.auth.cache_salt("default")
    finally:
        await app.stop()
        await rep.stop()


def test_tenants_never_share_block_hashes():
    app = RouterApp(config([], routing_policy="round_robin"))
    ids = list(PROMPT.encode())
    a = hash_token_blocks(ids, 16, cache_salt=app.auth.cache_salt("tenantA"))
    b = hash_token_blocks(ids, 16, cache_salt=app.auth.cache_salt("tenantB"))
    assert len(a) == len(b) == 3
    assert set(a).isdisjoint(b)
    assert make_routing_policy("round_robin").name == "round_robin"


async def test_unicache_status_against_live_router(cluster2, capsys):
    from unicache.cli.main import main

    app, _, _ = cluster2
    rc = await asyncio.to_thread(main, ["status", "--router", f"127.0.0.1:{app.grpc_port}"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "routing policy: round_robin   redis: DISCONNECTED   replicas: 2"
    assert [line.split()[0] for line in lines[2:]] == ["r0", "r1"]


async def test_http_listener_is_tcp_so_asyncio_sets_nodelay(single):
    import socket

    app, _, _ = single
    (listener,) = app._uvicorn.servers[0].sockets
    assert listener.proto == socket.IPPROTO_TCP


async def test_http_only_replica_fails_reports_unavailable_without_its_details(single):
    app, rep, client = single
    rep.fail_next = 1
    r = await client.post("/v1/completions", json={"prompt": PROMPT}, headers={"x-api-key": "key-a"})
    assert r.status_code == 503
    # The replica's transport-level details (which can name addresses) stay in the log.
    assert r.json()["error"]["message"] == "replica unavailable"
    assert app.cluster.replicas["solo"].in_flight == 0


async def test_health_and_reflection_services(cluster2):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    app, _, _ = cluster2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="unicache.v1.Router"), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = sorted([s.name async for r in call for s in r.list_services_response.service])
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "unicache.v1.Router"]


async def test_http_stream_client_disconnect_cancels_replica(single):
    app, rep, client = single
    rep.hold = asyncio.Event()
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-api-key": "key-a"}) as r:
        async for line in r.aiter_lines():
            if line:
                assert json.loads(line[6:])["choices"][0]["text"] == "T"
                break
    # Leaving the block closed the connection mid-stream.
    await asyncio.wait_for(rep.cancelled.wait(), 10)
    for _ in range(200):
        if app.cluster.replicas["solo"].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert app.cluster.replicas["solo"].in_flight == 0


async def test_http_prompt_as_token_ids(single):
    _, rep, client = single
    ids = list(PROMPT.encode())
    r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}, headers={"x-api-key": "key-a"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "T"
    assert list(rep.requests[0].token_ids.ids) == ids


async def test_http_non_streaming_client_disconnect_cancels_replica(single):
    app, rep, client = single
    rep.hold = asyncio.Event()
    post = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, headers={"x-api-key": "key-a"})
    )
    for _ in range(500):  # until the replica is generating
        if rep.requests:
            break
        await asyncio.sleep(0.01)
    post.cancel()  # the client gives up: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await post
    await asyncio.wait_for(rep.cancelled.wait(), 10)
    for _ in range(200):
        if app.cluster.replicas["solo"].in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert app.cluster.replicas["solo"].in_flight == 0
    text = (await client.get("/metrics")).text
    assert 'unicache_router_requests_total{api="completions",outcome="cancelled"} 1.0' in text
