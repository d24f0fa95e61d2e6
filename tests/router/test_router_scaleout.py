"""Several routers, one cluster: session placement shared through Redis.

Two ``RouterApp`` instances (what two ``--workers`` processes or two pods run) follow one
private redis-server in front of the same two fake replicas. Every session's turns go
alternately through router A and router B. With shared sessions every turn of a session
lands on its first turn's replica; with them off (each router remembers only what it
routed itself) the same traffic splits sessions, so the test can tell.

The replicas are static fakes that publish nothing, so the index vouches for nothing
(``is_stale``): the session's memory is all that keeps it in place, as while Redis's
events lag or the index resyncs.
"""

from __future__ import annotations

import random

import httpx
import pytest

from unicache.contract.state_auth import parse_cluster_key
from unicache.plumbing.errors import UsageError
from unicache.router.app import RouterApp
from unicache.router.cluster.session_store import SessionStore
from unicache.router.config import build_config
from unicache.router.routing.base import SessionRecord
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY

PREFIX = "scaleout"
SESSIONS = 24
TURNS = 4


async def start_router(redis_url: str, spec: str, shared: bool) -> RouterApp:
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:acme", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_url, "redis_prefix": PREFIX, "replicas": spec,
                   "tokenizer": "byte", "shared_sessions": shared,
                   # the default 50 ms deadline guards the request path against a slow Redis
                   # (test_store_degrades_when_redis_is_down); here one save past it on a
                   # loaded machine changed the counts these tests assert
                   "session_timeout_s": 5.0},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20})
    await app.start()
    return app


@pytest.fixture
async def replicas():
    fakes = [FakeReplica(f"r{i}") for i in range(2)]
    for f in fakes:
        await f.start()
    try:
        yield ",".join(f"{f.replica_id}={f.address}" for f in fakes)
    finally:
        for f in fakes:
            await f.stop()


async def alternate(redis_url: str, spec: str, shared: bool, keep: list | None = None, before_stop=None) -> dict[int, list[tuple[str, str]]]:
    """(replica, reason) of every turn of every session, turn t of session s sent through
    router (s + t) % 2; turn 1 of every session, then turn 2 of every session, ..., each
    turn's sessions in a shuffled order (fixed seeds) so the two routers see different
    histories. ``keep`` receives the (stopped) routers."""
    routers = [await start_router(redis_url, spec, shared) for _ in range(2)]
    if keep is not None:
        keep.extend(routers)
    try:
        await eventually(lambda: all(r.cluster.redis_connected for r in routers), "both routers on Redis")
        clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.http_port}", timeout=30) for r in routers]
        seen: dict[int, list[tuple[str, str]]] = {s: [] for s in range(SESSIONS)}
        prompts = {s: f"session {s} says hello. " * 3 for s in range(SESSIONS)}
        for turn in range(TURNS):
            order = list(range(SESSIONS))
            random.Random(turn).shuffle(order)
            for s in order:
                prompts[s] += f"turn {turn} of session {s} asks something new. "
                r = await clients[(s + turn) % 2].post(
                    "/v1/completions", json={"prompt": prompts[s], "max_tokens": 2},
                    headers={"x-api-key": "k", "x-session-id": f"conv-{s}"},
                )
                assert r.status_code == 200, r.text
                seen[s].append((r.headers["x-unicache-replica"], r.headers["x-unicache-route-reason"]))
        for c in clients:
            await c.aclose()
        if before_stop is not None:
            await before_stop(routers)
        return seen
    finally:
        for r in routers:
            await r.stop()


async def test_session_turns_through_two_routers_land_on_one_replica(redis_server, replicas):
    seen = await alternate(redis_server.url, replicas, shared=True)
    for s, turns in seen.items():
        home = turns[0][0]
        assert turns[1:] == [(home, "session_sticky")] * (TURNS - 1), (s, turns)
    assert {t[0][0] for t in seen.values()} == {"r0", "r1"}  # placement still spreads sessions


async def test_both_routers_count_their_store_calls(redis_server, replicas):
    """Every turn is one load and one save on the router that took it: a miss for each
    session's first turn, a hit for every later one, a save for each."""
    import prometheus_client

    routers: list = []
    seen = await alternate(redis_server.url, replicas, shared=True, keep=routers)
    assert len(seen) == SESSIONS
    totals: dict[tuple[str, str], float] = {}
    for r in routers:
        text = prometheus_client.generate_latest(r.metrics.registry).decode()
        for line in text.splitlines():
            if line.startswith("unicache_router_session_store_total{"):
                labels, value = line[len("unicache_router_session_store_total{"):].split("} ")
                d = dict(kv.split("=") for kv in labels.split(","))
                key = (d["op"].strip('"'), d["outcome"].strip('"'))
                totals[key] = totals.get(key, 0) + float(value)
    assert totals == {("load", "miss"): SESSIONS, ("load", "hit"): SESSIONS * (TURNS - 1), ("save", "saved"): SESSIONS * TURNS}


async def test_routers_sharing_sessions_share_the_policy_terms(redis_server, replicas):
    """Every routed event reaches both routers (each one's clock counts all turns) and
    their churn and footprint terms agree up to the exchange's lag."""
    got = {}

    async def settled(routers):
        policies = [r.policy for r in routers]
        await eventually(lambda: all(p._routed == SESSIONS * TURNS for p in policies), "every event applied by both")
        got["terms"] = [(p._inflow.as_dict(), p._footprint.as_dict()) for p in policies]
        got["exchanged"] = [r.terms.applied_events for r in routers]

    await alternate(redis_server.url, replicas, shared=True, before_stop=settled)
    (inflow_a, foot_a), (inflow_b, foot_b) = got["terms"]
    assert sum(got["exchanged"]) == SESSIONS * TURNS and min(got["exchanged"]) > 0
    assert set(inflow_a) == set(inflow_b) == {"r0", "r1"}
    for a, b in ((inflow_a, inflow_b), (foot_a, foot_b)):
        for r in a:
            # NOTE: each router applies the other's events up to one 50 ms round late, so
            # they decay by a few steps fewer than in the order routed (a step is 1/256 of
            # the churn term and 1/96 of the footprint's); each router alone would hold
            # about half the traffic's terms.
            assert a[r] == pytest.approx(b[r], rel=0.15), (r, a, b)


async def test_without_shared_sessions_the_same_traffic_splits_sessions(redis_server, replicas):
    seen = await alternate(redis_server.url, replicas, shared=False)
    split = [s for s, turns in seen.items() if len({r for r, _ in turns}) > 1]
    assert len(split) >= SESSIONS // 4, (len(split), seen)


# --- the store itself -------------------------------------------------------------------------

KEY = parse_cluster_key(CLUSTER_KEY)
H = [bytes([i]) * 16 for i in range(3)]


@pytest.fixture
async def store(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    try:
        yield SessionStore(client, PREFIX, KEY, timeout_s=1.0, ttl_s=60)
    finally:
        await client.aclose()


async def test_store_round_trip_and_ttl(store):
    assert await store.load("acme\x1fs1") is None
    assert await store.save("acme\x1fs1", SessionRecord("r1", H, True))
    assert await store.load("acme\x1fs1") == SessionRecord("r1", H, True)
    assert await store.load("acme\x1fs2") is None
    rkey = store.keys.session(store.digest("acme\x1fs1").hex())
    assert b"s1" not in rkey.encode() and 0 < await store.redis.pttl(rkey) <= 60_000
    assert (store.loads, store.hits, store.saves, store.errors, store.rejected) == (3, 1, 1, 0, 0)


async def test_store_refuses_forged_moved_and_foreign_records(store):
    await store.save("acme\x1fs1", SessionRecord("r1", H))
    k1 = store.keys.session(store.digest("acme\x1fs1").hex())
    k2 = store.keys.session(store.digest("acme\x1fs2").hex())
    await store.redis.set(k2, await store.redis.get(k1))  # a valid record copied to another session
    assert await store.load("acme\x1fs2") is None
    other = SessionStore(store.redis, PREFIX, b"another-cluster-key-0123", timeout_s=1.0)
    rkey, value = other.encode("acme\x1fs3", SessionRecord("r0", H))
    await store.redis.set(store.keys.session(store.digest("acme\x1fs3").hex()), value)  # sealed with another key
    assert await store.load("acme\x1fs3") is None
    raw = bytearray(await store.redis.get(k1))
    raw[-1] ^= 1
    await store.redis.set(k1, bytes(raw))  # tampered
    assert await store.load("acme\x1fs1") is None
    assert store.rejected == 3


async def test_store_degrades_when_redis_is_down(redis_server, store):
    redis_server.stop()
    assert await store.load("acme\x1fs1") is None
    assert not await store.save("acme\x1fs1", SessionRecord("r1", H))
    assert store.errors == 2


# --- the policy side: export on one router, import on another ------------------------------

def test_cache_aware_import_makes_another_router_decide_as_the_first():
    from unicache.contract.block_hash import hash_id_blocks
    from unicache.contract.request_class import RequestClass
    from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest
    from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
    from unicache.router.routing.keys import session_key
    from unicache.router.cluster.view import EmptyView

    def req(rid, ids, session="s"):
        h = hash_id_blocks(ids, 16)
        return RoutingRequest(rid, RequestClass(tenant="t", session_id=session), h, 16 * len(ids), 16)

    loads = [ReplicaLoad("r0", capacity_blocks=100, free_blocks=100), ReplicaLoad("r1", capacity_blocks=100, free_blocks=100)]
    a, b = CacheAwarePolicy(), CacheAwarePolicy()
    key = session_key("t", "s")
    first = req("q1", [1, 2, 3])
    a.on_request_routed(first, RouteDecision("r1", "load"))  # A placed turn 1 on r1
    b.on_request_routed(req("q0", [9, 8, 7, 6], "other"), RouteDecision("r0", "load"))  # B saw another session
    record = a.export_session(key)
    assert record == SessionRecord("r1", first.block_hashes, False, 1)  # A had routed 1 request
    assert b.export_session(key) is None
    b.import_session(key, record)
    assert b.export_session(key) == record
    assert b._footprint.as_dict() == pytest.approx({"r0": 4.0, "r1": 3.0})  # its own session, and the imported one
    second = req("q2", [1, 2, 3, 4])
    assert b.choose(second, loads, EmptyView()) == RouteDecision("r1", "session_sticky", matched_blocks=1)
    b.import_session(key, record)  # the same record again (this router wrote it): nothing moves
    assert b._footprint.get("r1") == pytest.approx(3.0)


async def test_no_store_for_a_policy_without_session_memory(redis_server):
    cfg = build_config(
        env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"redis_url": redis_server.url, "auth_enabled": False, "routing_policy": "round_robin", "shared_sessions": "on"},
    )
    apps = [RouterApp(cfg)]
    cfg.routing_policy = "cache_aware"
    apps.append(RouterApp(cfg))
    assert (apps[0].sessions, apps[1].sessions is not None) == (None, True)
    for app in apps:
        await app.subscriber.close()


@pytest.mark.parametrize(
    ("overrides", "shared"),
    [
        ({}, False),  # auto, a lone router: its memory answers every turn, no Redis calls
        ({"reuse_port": True}, True),  # auto, one of several processes on the ports (what --workers sets)
        ({"shared_sessions": "on"}, True),
        ({"shared_sessions": "off", "reuse_port": True}, False),
        ({"shared_sessions": True}, True),  # a boolean from a YAML config file
    ],
)
async def test_auto_shares_sessions_only_when_routers_share_ports(redis_server, overrides, shared):
    cfg = build_config(
        env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"}, overrides={"redis_url": redis_server.url, "auth_enabled": False, **overrides}
    )
    app = RouterApp(cfg)
    assert (app.sessions is not None) is shared
    await app.subscriber.close()


def test_a_bad_shared_sessions_value_is_refused_by_name():
    with pytest.raises(UsageError, match=r"shared_sessions must be one of auto, on, off, got 'sometimes'"):
        build_config(env={}, overrides={"shared_sessions": "sometimes"})
