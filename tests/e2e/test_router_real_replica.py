"""End to end with the real pieces: two real replicas (AsyncEngine with a tiny seeded model,
ReplicaServer on port 0, CachePublisher to a private redis-server) behind the router
(gRPC and HTTP). The second identical request must be routed to the replica that cached
the prompt, by the locality index, and be served from its cache."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.real_stack import RealReplica

BS = 16
PREFIX = "e2e"
PROMPT = "System: you are terse.\nUser: name three primes please.\n"  # 55 bytes: 3 full blocks


@pytest.fixture
async def stack(redis_server):
    reps = [RealReplica("r0", redis_server.url, PREFIX, block_size=BS), RealReplica("r1", redis_server.url, PREFIX, block_size=BS)]
    for r in reps:
        await r.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:acme", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": PREFIX, "block_size": BS},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05})
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["r0", "r1"] and not any(app.index.needs_resync(r) for r in ("r0", "r1")), "replicas")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    try:
        yield app, router_pb2_grpc.RouterStub(channel)
    finally:
        await channel.close()
        await app.stop()
        for r in reps:
            await r.stop()


async def test_second_request_hits_the_replica_that_cached_it(stack):
    app, stub = stack
    req = router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4))
    md = [("authorization", "Bearer k")]
    first = [m async for m in stub.Generate(req, metadata=md, timeout=30)]
    first_done = time.time()
    served = first[0].route.replica_id
    assert first[-1].usage.cached_tokens == 0 and first[-1].usage.prompt_tokens == 55
    # The replica publishes the prompt's 3 blocks (plus decode blocks); the index learns them.
    await eventually(lambda: app.index.num_blocks(served) >= 3, "events in the index")
    # NOTE: and a heartbeat taken after the request finished; one still showing it
    # running makes the served replica look busier, and cache_aware may rightly go elsewhere.
    # NOTE: the heartbeat must be one taken after the request finished: the router may still
    # hold an idle one from before the request while a newer "running" one waits in Redis.
    await eventually(
        lambda: (hb := app.cluster.replicas[served].heartbeat).timestamp > first_done and hb.running == hb.waiting == 0,
        "idle heartbeat taken after the first request",
    )
    assert app.cluster.total_in_flight() == 0
    second = [m async for m in stub.Generate(req, metadata=md, timeout=30)]
    assert second[0].route.replica_id == served
    assert second[0].route.reason == "index_prefix"
    assert second[0].route.matched_tokens == 48
    assert second[-1].usage.cached_tokens == 48
    assert [t for m in second for t in m.token_ids] == [t for m in first for t in m.token_ids]  # greedy

    # HTTP, streaming, same prompt: same replica, same tokens, cached tokens reported.
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as c:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body, headers={"x-api-key": "k"}) as r:
            assert r.headers["x-unicache-replica"] == served
            lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "".join(m.text for m in first)


async def test_unauthenticated_and_cluster_state(stack):
    app, stub = stack
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text=PROMPT), timeout=10)]
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    state = await stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=5)
    assert state.redis_connected
    assert [(s.info.replica_id, s.cache.capacity_blocks, s.cache.block_size) for s in state.replicas] == [("r0", 64, BS), ("r1", 64, BS)]
