"""The whole router process with its Redis subscriber loop (real redis-server on a free
port) in front of two in-process replicas: prefix routing from the index, serving through
a Redis outage, and rebuilding the index when Redis returns."""

from __future__ import annotations

import time

import httpx
import redis

from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, sealed
from unicache.v1 import cache_pb2
from tests.router.test_router_subscriber import KEYS

PROMPT = "A shared system prompt that is long enough for three blocks."


def publish(r: redis.Redis, reps: list[FakeReplica], holdings: dict[str, list[bytes]]) -> None:
    """A sealed heartbeat per replica (seq advancing per call) and what each replica's
    GetCacheSummary will claim."""
    for rep in reps:
        seq = _SEQ[rep.replica_id] = _SEQ.get(rep.replica_id, 0) + 1
        hb = cache_pb2.Heartbeat(replica_id=rep.replica_id, address=rep.address, epoch=1, seq=seq, timestamp=time.time())
        hb.cache.capacity_blocks, hb.cache.free_blocks = 100, 100
        r.set(KEYS.heartbeat(rep.replica_id), sealed("hb", hb), ex=30)
        rep.summary_blocks = holdings.get(rep.replica_id, [])


_SEQ: dict[str, int] = {}


async def shut_down(r: redis.Redis, client, app: RouterApp, reps: list[FakeReplica]) -> None:
    """A test's teardown: its Redis client, its HTTP client, the router, then the replicas."""
    r.close()
    await client.aclose()
    await app.stop()
    for rep in reps:
        await rep.stop()


async def test_prefix_routing_through_redis_outage(redis_server):
    reps = [FakeReplica("r0"), FakeReplica("r1")]
    for rep in reps:
        await rep.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:tenantA", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": KEYS.prefix},
    )
    app = RouterApp(
        cfg,
        subscriber_kwargs={
            "heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05,
            "backoff_initial_s": 0.02, "backoff_max_s": 0.1, "reconnect_grace_s": 30.0,
            "heartbeat_ttl_s": 60.0,  # the test beats once per phase
        },
    )
    hashes = hash_token_blocks(list(PROMPT.encode()), 16, cache_salt=app.auth.cache_salt("tenantA"))
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    publish(r, reps, {"r1": hashes})
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10, headers={"x-api-key": "k"})
    try:
        await eventually(lambda: app.index.num_blocks("r1") == 3 and "r0" in app.cluster.replicas, "index from Redis")
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert resp.headers["x-unicache-replica"] == "r1"
        assert resp.headers["x-unicache-route-reason"] == "index_prefix"
        assert resp.headers["x-unicache-matched-tokens"] == "48"

        redis_server.kill()
        await eventually(lambda: not app.cluster.redis_connected, "subscriber to notice the outage")
        resp = await client.post("/v1/completions", json={"prompt": "unrelated prompt", "max_tokens": 1})
        assert resp.status_code == 200  # still serving, from the last known replicas
        assert (await client.get("/healthz")).json()["redis_connected"] is False
        assert sorted(app.cluster.replicas) == ["r0", "r1"]

        redis_server.start()
        r2 = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        publish(r2, reps, {"r0": hashes})  # after the restart r0 holds the prefix
        await eventually(
            lambda: app.cluster.redis_connected and app.index.num_blocks("r0") == 3 and app.index.num_blocks("r1") == 0,
            "index rebuilt after Redis returned",
        )
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert resp.headers["x-unicache-replica"] == "r0"
        assert resp.headers["x-unicache-route-reason"] == "index_prefix"
        assert app.subscriber.reconnects == 1
        r2.close()
    finally:
        await shut_down(r, client, app, reps)
