"""Attacks on the control plane by someone who can read and write Redis (the worst case:
they know the Redis password) but not the cluster key. Each runs against a real
redis-server on a free port and asserts the exact outcome: who is a member, which address
the router dials, what the index holds (equal to the replica's true holdings), which
peers were ever asked for a summary (a forger is never contacted), and what was counted.
The replica side: calls without the cluster credential are refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.serving.server import ReplicaServer
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.subscriber import RedisSubscriber
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.baselines.round_robin import RoundRobinPolicy
from unicache.contract.state_auth import (
    CALL_METADATA,
    CallCredential,
    StateAuthError,
    StateSigner,
    new_cluster_key,
    parse_cluster_key,
)
from unicache.testing.signed_state import CLUSTER_KEY, SIGNER, ReplicaTruth, call_metadata, sealed
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc
from tests.router.test_router_subscriber import KEYS, FakeClock, add_events, h, heartbeat, held, put_heartbeat, replica_has
from tests.support.engine_factory import tiny_config

FORGER = "127.0.0.1:6666"
OTHER_KEY = StateSigner(parse_cluster_key(new_cluster_key()))  # what a forger can sign with


@pytest.fixture
async def setup(redis_server):
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex())
    clock = FakeClock()
    truth = ReplicaTruth()
    # The forger answers summaries at its own address, signed with its own key.
    forger = ReplicaTruth(OTHER_KEY)
    calls: list[str] = []

    async def fetch(address, nonce, timeout_s):
        calls.append(address)
        if address == FORGER:
            return await forger.fetch(address, nonce, timeout_s)
        return await truth.fetch(address, nonce, timeout_s)

    sub = RedisSubscriber(
        cluster, redis_server.url, KEYS.prefix, timeout_s=2.0, heartbeat_interval_s=0.0, resync_retry_s=0.0,
        clock=clock, signer=SIGNER, fetch_summary=fetch,
    )
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    yield sub, cluster, r, clock, truth, forger, calls
    await sub.close()
    r.close()


def forged_heartbeat(rid: str, address: str = FORGER, signer: StateSigner | None = None) -> bytes:
    hb = heartbeat(rid)
    hb.address = address
    return signer.seal("hb", hb.SerializeToString()) if signer else hb.SerializeToString()


async def steps(sub, n: int = 3) -> None:
    for _ in range(n):
        await sub.step(block_ms=0)


async def test_forged_new_replica_never_joins_and_is_never_contacted(setup):
    sub, cluster, r, _, truth, forger, calls = setup
    put_heartbeat(r, "a")
    replica_has(truth, "a", 1, 0, [1, 2])
    forger.set(FORGER, "evil-2", 1, 0, [1, 2])
    await sub.step(block_ms=0)
    r.set(KEYS.heartbeat("evil-0"), forged_heartbeat("evil-0"))                   # unsigned
    r.set(KEYS.heartbeat("evil-1"), forged_heartbeat("evil-1", signer=OTHER_KEY))  # another key
    r.set(KEYS.heartbeat("evil-2"), r.get(KEYS.heartbeat("a")))                   # a's real beat, copied
    r.set(KEYS.summary("evil-2"), r.get(KEYS.summary("a")) or b"")
    await steps(sub)
    assert sorted(cluster.replicas) == ["a"] and cluster.index.replicas() == ["a"]
    assert calls == ["127.0.0.1:7000"]  # only the genuine replica was ever asked
    assert held(cluster.index, "a") == [1, 2]
    assert (sub.rejections.counts["bad_mac"], sub.rejections.counts["wrong_replica"]) == (6, 3)


async def test_address_takeover_is_refused(setup):
    sub, cluster, r, _, truth, _, calls = setup
    put_heartbeat(r, "a")
    replica_has(truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    real = r.get(KEYS.heartbeat("a"))
    payload = cache_pb2.Heartbeat.FromString(SIGNER.open("hb", real))
    payload.address, payload.seq = FORGER, payload.seq + 1
    tampered = real[:36] + payload.SerializeToString()  # the old MAC over a new payload
    for value in (tampered, forged_heartbeat("a"), forged_heartbeat("a", signer=OTHER_KEY)):
        r.set(KEYS.heartbeat("a"), value)
        await sub.step(block_ms=0)
        assert cluster.replicas["a"].address == "127.0.0.1:7000"
    assert sorted(cluster.replicas) == ["a"] and calls == ["127.0.0.1:7000"]
    assert sub.rejections.counts["bad_mac"] == 3


async def test_replayed_old_heartbeat_after_a_restart_is_dropped(setup):
    sub, cluster, r, _, truth, forger, calls = setup
    put_heartbeat(r, "a", epoch=1, port=7000)
    replica_has(truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    captured = r.get(KEYS.heartbeat("a"))
    put_heartbeat(r, "a", epoch=1, port=7000)
    await sub.step(block_ms=0)
    r.set(KEYS.heartbeat("a"), captured)  # an older (epoch, seq): replay
    await sub.step(block_ms=0)
    assert sub.rejections.counts["replay"] == 1 and cluster.replicas["a"].address == "127.0.0.1:7000"
    # a restarts on another port with a new epoch; a forger takes the old port and the
    # attacker keeps replaying the captured old heartbeat naming it.
    del truth.by_address["127.0.0.1:7000"]
    forger.set("127.0.0.1:7000", "a", 1, 0, [1, 2, 3])
    put_heartbeat(r, "a", epoch=2, port=7001)
    replica_has(truth, "a", 2, 0, [9], port=7001)
    await sub.step(block_ms=0)
    assert cluster.replicas["a"].address == "127.0.0.1:7001" and held(cluster.index, "a") == [9]
    for _ in range(3):
        r.set(KEYS.heartbeat("a"), captured)
        await sub.step(block_ms=0)
    assert cluster.replicas["a"].address == "127.0.0.1:7001" and held(cluster.index, "a") == [9]
    assert calls == ["127.0.0.1:7000", "127.0.0.1:7001"]  # the old port was never asked again
    assert sub.rejections.counts["replay"] == 4


async def test_old_heartbeat_replayed_to_a_fresh_router_is_stale(setup):
    sub, cluster, r, _, truth, _, calls = setup
    hb = heartbeat("a")
    hb.timestamp = time.time() - 31  # older than max_state_age_s
    r.set(KEYS.heartbeat("a"), sealed("hb", hb))
    replica_has(truth, "a", 1, 0, [1])
    await steps(sub, 2)
    assert cluster.replicas == {} and calls == [] and sub.rejections.counts["stale"] == 2


async def test_a_dead_replicas_last_heartbeat_replayed_expires_after_the_ttl(setup):
    sub, cluster, r, clock, truth, _, _ = setup
    put_heartbeat(r, "a")
    replica_has(truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    last = r.get(KEYS.heartbeat("a"))
    clock.t += 2.0
    r.set(KEYS.heartbeat("a"), last)  # the replica died; its last beat is set again
    truth.forget("127.0.0.1:7000")  # nothing answers as it
    await sub.step(block_ms=0)
    assert sorted(cluster.replicas) == ["a"]  # within one TTL of its last advance
    clock.t += 1.5
    await sub.step(block_ms=0)
    assert cluster.replicas == {} and sub.rejections.counts["stale"] == 1


async def test_forged_and_replayed_events_leave_the_index_true(setup):
    sub, cluster, r, _, truth, _, _ = setup
    put_heartbeat(r, "a")
    put_heartbeat(r, "b", port=7001)
    replica_has(truth, "a", 1, 0, [1, 2])
    replica_has(truth, "b", 1, 0, [5], port=7001)
    await sub.step(block_ms=0)
    add_events(r, "a", 1, 1, stored=[3])
    add_events(r, "b", 1, 1, stored=[6])
    await sub.step(block_ms=0)
    genuine_a1 = r.xrange(KEYS.events("a"))[-1][1][b"b"]
    genuine_b1 = r.xrange(KEYS.events("b"))[-1][1][b"b"]
    # 3,849 blocks claimed for a, b's blocks removed, b's batch copied into a's stream,
    # a's own batch replayed.
    claim = cache_pb2.KVEventBatch(replica_id="a", epoch=1, seq=2, stored=[h(1000 + i) for i in range(3849)])
    r.xadd(KEYS.events("a"), {"b": claim.SerializeToString()})
    r.xadd(KEYS.events("a"), {"b": OTHER_KEY.seal("events", claim.SerializeToString())})
    removal = cache_pb2.KVEventBatch(replica_id="b", epoch=1, seq=2, removed=[h(5), h(6)])
    r.xadd(KEYS.events("b"), {"b": removal.SerializeToString()})
    r.xadd(KEYS.events("a"), {"b": genuine_b1})
    r.xadd(KEYS.events("a"), {"b": genuine_a1})
    await sub.step(block_ms=0)
    add_events(r, "a", 1, 2, removed=[1])  # the replica goes on publishing
    await sub.step(block_ms=0)
    assert (held(cluster.index, "a"), held(cluster.index, "b")) == ([2, 3], [5, 6])
    assert not cluster.index.needs_resync("a") and not cluster.index.needs_resync("b")
    counts = sub.rejections.counts
    assert (counts["bad_mac"], counts["wrong_replica"], counts["replay"], counts["gap"]) == (3, 1, 1, 0)


async def test_claim_beyond_capacity_is_cut_and_resynced_from_the_replica(setup):
    sub, cluster, r, _, truth, _, calls = setup
    put_heartbeat(r, "a", capacity=4)
    replica_has(truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    # Even a correctly signed batch (a leaked key, a buggy replica) cannot claim more.
    add_events(r, "a", 1, 1, stored=list(range(10, 20)))
    await sub.step(block_ms=0)
    assert cluster.index.num_blocks("a") == 4 and cluster.index.needs_resync("a")
    assert sub.rejections.counts["over_capacity"] == 1
    replica_has(truth, "a", 1, 1, [1, 10, 11])
    await sub.step(block_ms=0)
    assert held(cluster.index, "a") == [1, 10, 11] and not cluster.index.needs_resync("a")
    assert calls == ["127.0.0.1:7000", "127.0.0.1:7000"]


@pytest.mark.parametrize(
    "answer, reason",
    [("other_key", "bad_mac"), ("other_replica", "wrong_replica"), ("other_nonce", "identity")],
)
async def test_peer_that_cannot_prove_it_is_the_replica_is_not_admitted(redis_server, answer, reason):
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex())

    async def fetch(address, nonce, timeout_s):  # noqa: ARG001
        summary = cache_pb2.CacheSummary(replica_id="a", epoch=1, seq=0, block_hashes=[h(1)], nonce=nonce)
        if answer == "other_replica":
            summary.replica_id = "b"
        if answer == "other_nonce":
            summary.nonce = bytes(16)
        return (OTHER_KEY if answer == "other_key" else SIGNER).seal("rpc-summary", summary.SerializeToString())

    sub = RedisSubscriber(
        cluster, redis_server.url, KEYS.prefix, heartbeat_interval_s=0.0, resync_retry_s=0.0,
        signer=SIGNER, fetch_summary=fetch,
    )
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    try:
        put_heartbeat(r, "a")
        await steps(sub, 2)
        assert cluster.replicas == {} and sub.rejections.counts[reason] == 2 and sub.rejections.total() == 2
    finally:
        await sub.close()
        r.close()


def test_state_envelope_binds_kind_and_key():
    sealed_hb = SIGNER.seal("hb", b"payload")
    assert SIGNER.open("hb", sealed_hb) == b"payload"
    for bad in (sealed_hb[:-1] + b"X", b"payload", b"", None):
        with pytest.raises(StateAuthError) as err:
            SIGNER.open("hb", bad)
        assert err.value.reason == "bad_mac"
    with pytest.raises(StateAuthError):
        SIGNER.open("summary", sealed_hb)  # a heartbeat is not a summary
    with pytest.raises(StateAuthError):
        OTHER_KEY.open("hb", sealed_hb)
    with pytest.raises(ValueError, match="too short"):
        parse_cluster_key("short")
    assert parse_cluster_key("ab" * 16) == bytes.fromhex("ab" * 16)
    assert "5e" not in repr(SIGNER)


def test_call_credential_expires_and_binds_the_key():
    now = [1_000_000.0]
    cred = CallCredential(parse_cluster_key(CLUSTER_KEY), clock=lambda: now[0])
    token = cred.token()
    cred.check(token)
    now[0] += 5
    assert cred.token() == token  # reused within refresh_s
    now[0] += 61
    with pytest.raises(StateAuthError) as err:
        cred.check(token)
    assert err.value.reason == "stale"
    other = CallCredential(parse_cluster_key(new_cluster_key()), clock=lambda: now[0])
    for bad, reason in ((other.token(), "bad_mac"), ("", "missing"), ("12.zz", "bad_mac"), ("x.y", "bad_mac")):
        with pytest.raises(StateAuthError) as err:
            cred.check(bad)
        assert err.value.reason == reason


@pytest.fixture
async def keyed_replica():
    engine = AsyncEngine(tiny_config())
    await engine.start()
    server = ReplicaServer(engine, "r0", cluster_key=parse_cluster_key(CLUSTER_KEY))

    async def summary_source(nonce: bytes) -> bytes:
        s = cache_pb2.CacheSummary(replica_id="r0", epoch=7, seq=0, nonce=nonce)
        return SIGNER.seal("rpc-summary", s.SerializeToString())

    server.servicer.summary_source = summary_source
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, replica_pb2_grpc.ReplicaStub(channel)
    finally:
        await channel.close()
        await server.stop()
        await engine.stop()


async def test_replica_refuses_every_call_without_the_cluster_credential(keyed_replica):
    server, stub = keyed_replica
    gen = replica_pb2.GenerateRequest(
        token_ids=replica_pb2.TokenIds(ids=list(range(1, 40))), sampling=common_pb2.SamplingParams(max_tokens=2),
        cache_salt=b"captured-salt-16",
    )
    other = CallCredential(parse_cluster_key(new_cluster_key())).metadata()
    expired = CallCredential(parse_cluster_key(CLUSTER_KEY), clock=lambda: time.time() - 120).metadata()
    calls = {
        "Generate": lambda md: _drain(stub.Generate(gen, timeout=30, metadata=md)),
        "GetCacheState": lambda md: stub.GetCacheState(replica_pb2.GetCacheStateRequest(), timeout=30, metadata=md),
        "GetCacheSummary": lambda md: stub.GetCacheSummary(replica_pb2.GetCacheSummaryRequest(nonce=bytes(16)), timeout=30, metadata=md),
    }
    for name, call in calls.items():
        for md, why in ((None, "missing"), (other, "invalid"), (expired, "expired"), (((CALL_METADATA, "1.ab"),), "invalid")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert why in err.value.details() and "ab" not in err.value.details().split(":")[-1].replace("cluster", "")
    assert server.auth.refused == 12
    assert server.servicer.engine.num_referenced_blocks() == 0  # nothing reached the engine
    # The router's credential works.
    tokens = await _drain(stub.Generate(gen, timeout=60, metadata=call_metadata()))
    assert len(tokens) == 2
    state = await stub.GetCacheState(replica_pb2.GetCacheStateRequest(), timeout=30, metadata=call_metadata())
    assert state.replica_id == "r0"
    resp = await stub.GetCacheSummary(replica_pb2.GetCacheSummaryRequest(nonce=b"n" * 16), timeout=30, metadata=call_metadata())
    opened = cache_pb2.CacheSummary.FromString(SIGNER.open("rpc-summary", resp.signed_summary))
    assert (opened.replica_id, opened.epoch, opened.nonce) == ("r0", 7, b"n" * 16)


async def _drain(call) -> list[int]:
    return [t async for m in call for t in m.token_ids]


async def test_admin_key_guards_operator_endpoints():
    import httpx

    from unicache.router.app import RouterApp
    from unicache.router.config import build_config

    cfg = build_config(
        env={"UNICACHE_ADMIN_KEY": "adm-key-93e1"},
        overrides={"grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False},
    )
    app = RouterApp(cfg)
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as c:
            for path in ("/metrics", "/v1/cluster/state", "/v1/cluster/costs", "/dashboard"):
                for headers in ({}, {"authorization": "Bearer wrong"}):
                    resp = await c.get(path, headers=headers)
                    assert resp.status_code == 401
                    assert resp.json() == {"error": {"message": "admin key required", "type": "authentication_error",
                                                     "param": None, "code": "invalid_api_key"}}
                assert (await c.get(path, headers={"authorization": "Bearer adm-key-93e1"})).status_code == 200
            assert (await c.get("/healthz")).status_code == 200  # probes stay open
            metrics = (await c.get("/metrics", headers={"x-api-key": "adm-key-93e1"})).text
            assert 'unicache_router_state_rejected_total{reason="bad_mac"} 0.0' in metrics
    finally:
        await app.stop()


async def test_admin_key_guards_grpc_cluster_state_and_status_presents_it(monkeypatch, tmp_path):
    import asyncio

    from unicache.plumbing.errors import UsageError
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config
    from unicache.router.observability.status import admin_key_from_env, fetch_cluster_state
    from unicache.v1 import router_pb2, router_pb2_grpc

    cfg = build_config(
        env={"UNICACHE_ADMIN_KEY": "adm-key-93e1"},
        overrides={"grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False},
    )
    app = RouterApp(cfg)
    await app.start()
    address = f"127.0.0.1:{app.grpc_port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            calls = {
                "ListReplicas": lambda md: stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=10, metadata=md),
                "GetClusterState": lambda md: stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=10, metadata=md),
            }
            for name, call in calls.items():
                for md in (None, (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(md)
                    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "admin key required"), name
                await call((("x-api-key", "adm-key-93e1"),))  # the key opens both
        # `unicache status` reads the key from the environment or a file, and says which
        # setting is missing when the router wants one.
        monkeypatch.delenv("UNICACHE_ADMIN_KEY", raising=False)
        monkeypatch.delenv("UNICACHE_ADMIN_KEY_FILE", raising=False)
        with pytest.raises(UsageError, match="wants its admin key: set UNICACHE_ADMIN_KEY or UNICACHE_ADMIN_KEY_FILE"):
            await asyncio.to_thread(fetch_cluster_state, address, 10, admin_key_from_env())
        (tmp_path / "admin").write_text("adm-key-93e1\n")
        monkeypatch.setenv("UNICACHE_ADMIN_KEY_FILE", str(tmp_path / "admin"))
        state = await asyncio.to_thread(fetch_cluster_state, address, 10, admin_key_from_env())
        assert state.routing_policy == app.policy.name
    finally:
        await app.stop()
