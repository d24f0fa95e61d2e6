"""Someone with the Redis password deletes live replicas' keys (issue 39): the router
keeps every replica that still answers as itself over its own channel, so no client
request fails; a replica that is really gone is still dropped.

The whole router (real redis-server, its subscriber at its default heartbeat scan and
TTL) in front of two fake replicas that beat every second as a publisher does, while
an attacker deletes both replicas' heartbeat and summary keys at 20 Hz for 6 s.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import redis

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, sealed
from unicache.v1 import cache_pb2
from tests.e2e.test_router_redis_e2e import shut_down
from tests.router.test_router_subscriber import KEYS

ATTACK_S = 6.0
DELETE_EVERY_S = 0.05  # 20 Hz


async def beat_forever(r: redis.Redis, reps: list[FakeReplica], every_s: float = 1.0) -> None:
    """What each replica's publisher does: a sealed heartbeat (seq advancing) every second
    with the 3 s TTL."""
    seq = 0
    while True:
        seq += 1
        for rep in reps:
            hb = cache_pb2.Heartbeat(replica_id=rep.replica_id, address=rep.address, epoch=1, seq=seq, timestamp=time.time())
            hb.cache.capacity_blocks, hb.cache.free_blocks = 100, 100
            r.set(KEYS.heartbeat(rep.replica_id), sealed("hb", hb), ex=3)
            r.set(KEYS.summary(rep.replica_id), b"x", ex=3)
        await asyncio.sleep(every_s)


async def delete_keys(r: redis.Redis, reps: list[FakeReplica], for_s: float) -> int:
    """Delete every heartbeat and summary key at 20 Hz for ``for_s``; the rounds done."""
    rounds, end = 0, time.monotonic() + for_s
    while time.monotonic() < end:
        r.delete(*[k for rep in reps for k in (KEYS.heartbeat(rep.replica_id), KEYS.summary(rep.replica_id))])
        rounds += 1
        await asyncio.sleep(DELETE_EVERY_S)
    return rounds


async def test_deleting_live_replicas_keys_for_6s_fails_no_request(redis_server):
    reps = [FakeReplica("r0"), FakeReplica("r1")]
    for rep in reps:
        await rep.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:tenantA", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": KEYS.prefix,
                   "routing_policy": "round_robin"},
    )
    app = RouterApp(cfg)
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    beating = list(reps)  # the replicas whose publishers run
    beats = asyncio.create_task(beat_forever(r, beating))
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10, headers={"x-api-key": "k"})
    try:
        await eventually(lambda: sorted(app.cluster.replicas) == ["r0", "r1"], "both replicas admitted")
        attack = asyncio.create_task(delete_keys(r, reps, ATTACK_S))
        statuses, members = [], []
        while not attack.done():
            resp = await client.post("/v1/completions", json={"prompt": f"request {len(statuses)}", "max_tokens": 1})
            statuses.append(resp.status_code)
            members.append(tuple(sorted(app.cluster.replicas)))
            await asyncio.sleep(0.1)
        rounds = await attack
        assert rounds >= ATTACK_S / DELETE_EVERY_S / 4  # the attack really ran (a slow machine does fewer rounds)
        assert len(statuses) >= 20
        assert statuses == [200] * len(statuses)
        assert set(members) == {("r0", "r1")}  # never out of routing
        assert app.subscriber.kept_alive > 0  # kept by their own proofs, not by luck
        served = {rep.replica_id: len(rep.served) for rep in reps}
        assert served["r0"] + served["r1"] == len(statuses) and min(served.values()) >= len(statuses) // 2 - 1

        # A replica that is really gone is still dropped, keys deleted or not.
        beating.remove(reps[1])
        await reps[1].stop()
        await eventually(lambda: sorted(app.cluster.replicas) == ["r0"], "the stopped replica dropped", timeout_s=30)
        resp = await client.post("/v1/completions", json={"prompt": "after", "max_tokens": 1})
        assert resp.status_code == 200 and resp.headers["x-unicache-replica"] == "r0"
    finally:
        beats.cancel()
        await shut_down(r, client, app, reps)
