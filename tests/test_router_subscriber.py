"""The Redis subscriber against a real redis-server on a free port: events, gaps, epochs,
Redis outages and heartbeat expiry. Payloads are written into Redis directly as the
replicas' publisher would (protobuf, keys from unicache.redis_keys)."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.router.cluster import ClusterView, EmptyView
from unicache.router.index import LocalityIndex
from unicache.router.routing.base import RoutingPolicy
from unicache.router.subscriber import REDIS_ERRORS, RedisSubscriber
from unicache.block_hash import BlockHash
from unicache.redis_keys import RedisKeys
from unicache.v1 import cache_pb2, common_pb2

KEYS = RedisKeys("t1")


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


class RecordingPolicy(RoutingPolicy):
    """Records the lifecycle hooks the cluster view calls."""

    def __init__(self):
        self.calls: list[tuple] = []

    def choose(self, request, replicas, index):  # pragma: no cover - not routed here
        raise AssertionError

    def update_replicas(self, replica_ids):
        self.calls.append(("update", tuple(replica_ids)))

    def on_replica_died(self, replica_id):
        self.calls.append(("died", replica_id))


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def put_heartbeat(r: redis.Redis, rid: str, epoch: int = 1, port: int = 7000, ttl_s: int = 30) -> None:
    hb = cache_pb2.Heartbeat(
        replica_id=rid, address=f"127.0.0.1:{port}", device="cpu", running=2, waiting=1, epoch=epoch,
        cache=common_pb2.CacheState(replica_id=rid, capacity_blocks=100, used_blocks=10, free_blocks=90, hit_ratio=0.5),
    )
    r.set(KEYS.heartbeat(rid), hb.SerializeToString(), ex=ttl_s)


def put_summary(r: redis.Redis, rid: str, epoch: int, seq: int, blocks: list[int]) -> None:
    s = cache_pb2.CacheSummary(replica_id=rid, epoch=epoch, seq=seq, block_hashes=[h(i) for i in blocks], block_size=16)
    r.set(KEYS.summary(rid), s.SerializeToString())


def add_events(r: redis.Redis, rid: str, epoch: int, seq: int, stored=(), removed=(), cleared=False) -> None:
    b = cache_pb2.KVEventBatch(
        replica_id=rid, epoch=epoch, seq=seq, stored=[h(i) for i in stored], removed=[h(i) for i in removed], cleared=cleared
    )
    r.xadd(KEYS.events(rid), {"b": b.SerializeToString()})


def held(index: LocalityIndex, rid: str) -> list[int]:
    return sorted(int.from_bytes(b, "little") for b in index.holdings(rid).blocks)


@pytest.fixture
async def setup(redis_server):
    policy = RecordingPolicy()
    index = LocalityIndex(max_blocks_per_replica=1000)
    cluster = ClusterView(policy, index)
    clock = FakeClock()
    sub = RedisSubscriber(
        cluster, redis_server.url, KEYS.prefix, timeout_s=2.0, heartbeat_interval_s=0.0, resync_retry_s=0.0,
        reconnect_grace_s=3.0, clock=clock,
    )
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    yield sub, cluster, index, policy, r, clock
    await sub.close()
    r.close()


async def test_summary_then_events_then_gap_resync(setup):
    sub, cluster, index, policy, r, _ = setup
    put_heartbeat(r, "a")
    add_events(r, "a", 1, 1, stored=[1])            # folded into the summary already
    add_events(r, "a", 1, 2, stored=[2])            # folded too
    put_summary(r, "a", 1, 2, [1, 2])
    add_events(r, "a", 1, 3, stored=[3, 4])
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"]
    assert cluster.replicas["a"].address == "127.0.0.1:7000"
    assert policy.calls == [("update", ("a",))]
    assert held(index, "a") == [1, 2, 3, 4]
    assert index.holdings("a").applied_seq == 3 and not index.needs_resync("a")
    assert cluster.redis_connected

    add_events(r, "a", 1, 4, stored=[5], removed=[1])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4, 5]

    # seq 5 is lost: seq 6 is a gap -> resync requested on the channel.
    pubsub = r.pubsub()
    pubsub.subscribe(KEYS.resync_channel())
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    add_events(r, "a", 1, 6, stored=[7])
    await sub.step(block_ms=0)
    assert index.needs_resync("a")
    await sub.step(block_ms=0)  # summary still at seq 2 (stale): ask for a fresh one
    msg = pubsub.get_message(timeout=2)
    assert msg["type"] == "message" and msg["data"] == b"a"
    assert index.needs_resync("a")
    # The replica answers with a fresh summary at seq 6; then live events continue.
    put_summary(r, "a", 1, 6, [2, 3, 4, 5, 6, 7])
    await sub.step(block_ms=0)
    assert not index.needs_resync("a")
    assert held(index, "a") == [2, 3, 4, 5, 6, 7]
    add_events(r, "a", 1, 7, removed=[2])
    await sub.step(block_ms=0)
    assert held(index, "a") == [3, 4, 5, 6, 7]
    pubsub.close()


async def test_epoch_change_resyncs_from_new_summary(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a", epoch=1)
    put_summary(r, "a", 1, 0, [1, 2, 3])
    await sub.step(block_ms=0)
    assert held(index, "a") == [1, 2, 3]
    # The replica restarted: new epoch, empty cache, new events.
    put_heartbeat(r, "a", epoch=2)
    put_summary(r, "a", 2, 0, [])
    add_events(r, "a", 2, 1, stored=[9])
    await sub.step(block_ms=0)
    assert index.holdings("a").epoch == 2
    assert held(index, "a") == [9]


async def test_new_replica_added_and_expired_replica_dropped(setup):
    sub, cluster, index, policy, r, _ = setup
    put_heartbeat(r, "a")
    put_summary(r, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    put_heartbeat(r, "b", port=7001)
    put_summary(r, "b", 1, 0, [5, 6])
    await sub.step(block_ms=0)
    assert sorted(cluster.replicas) == ["a", "b"]
    assert held(index, "b") == [5, 6]
    r.delete(KEYS.heartbeat("a"))  # what TTL expiry does
    await sub.step(block_ms=0)
    assert sorted(cluster.replicas) == ["b"]
    assert index.replicas() == ["b"]
    assert policy.calls == [("update", ("a",)), ("update", ("a", "b")), ("died", "a"), ("update", ("b",))]
    assert [l.replica_id for l in cluster.loads()] == ["b"]
    assert (cluster.loads()[0].running, cluster.loads()[0].waiting, cluster.loads()[0].free_blocks) == (2, 1, 90)


async def test_redis_outage_keeps_replicas_then_rebuilds(setup, redis_server):
    sub, cluster, index, _, r, clock = setup
    put_heartbeat(r, "a")
    put_summary(r, "a", 1, 0, [1, 2])
    await sub.step(block_ms=0)
    assert cluster.locality() is index

    redis_server.kill()
    with pytest.raises(REDIS_ERRORS):
        await sub.step(block_ms=0)
    assert cluster.redis_connected is False
    assert list(cluster.replicas) == ["a"]           # last known replicas kept
    assert isinstance(cluster.locality(), EmptyView)  # policies route on session + load
    assert cluster.locality().match("a", [h(1)]) == 0

    redis_server.start()  # same port, empty database
    await sub.step(block_ms=0)
    assert cluster.redis_connected and sub.reconnects == 1
    assert list(cluster.replicas) == ["a"]  # no heartbeat yet, but inside the grace period
    assert index.needs_resync("a")
    # The replica republishes (its next heartbeat, and a summary on the resync request).
    r2 = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    put_heartbeat(r2, "a")
    put_summary(r2, "a", 1, 5, [2, 3])
    add_events(r2, "a", 1, 6, stored=[4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4] and not index.needs_resync("a")
    # After the grace period a replica without heartbeat is dropped.
    r2.delete(KEYS.heartbeat("a"))
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"]
    clock.t += 3.5
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == []
    r2.close()


async def test_resync_reads_only_batches_after_the_summary(setup, redis_server):
    sub, cluster, index, _, r, _ = setup
    sub.replay_chunk = 2  # force several XREVRANGE pages
    put_heartbeat(r, "a", epoch=2)
    for seq in (1, 2, 3):
        add_events(r, "a", 1, seq, stored=[100 + seq])  # an older epoch: ignored
    for seq in range(1, 8):
        add_events(r, "a", 2, seq, stored=[seq])
    put_summary(r, "a", 2, 4, [1, 2, 3, 4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [1, 2, 3, 4, 5, 6, 7]
    assert index.holdings("a").applied_seq == 7 and not index.needs_resync("a")
    # Live events continue from the newest entry.
    add_events(r, "a", 2, 8, removed=[1])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4, 5, 6, 7]


async def test_summary_older_than_trimmed_stream_is_requested_again(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    for seq in (5, 6):  # batches 1..4 were trimmed away
        add_events(r, "a", 1, seq, stored=[seq])
    put_summary(r, "a", 1, 2, [1, 2])
    await sub.step(block_ms=0)
    assert index.needs_resync("a") and sub.resync_requests == 1
    put_summary(r, "a", 1, 6, [1, 2, 5, 6])
    await sub.step(block_ms=0)
    assert not index.needs_resync("a") and held(index, "a") == [1, 2, 5, 6]


async def test_corrupt_payloads_do_not_stop_the_subscriber(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    r.set(KEYS.summary("a"), b"\xff\xff not a protobuf")
    r.set(KEYS.heartbeat("junk"), b"\xff\xff")
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"] and index.needs_resync("a") and sub.resync_requests == 1
    put_summary(r, "a", 1, 0, [3])
    r.xadd(KEYS.events("a"), {"b": b"\xff\xff"})
    add_events(r, "a", 1, 1, stored=[4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [3, 4]


async def test_block_size_mismatch_is_logged_once(setup, caplog):
    sub, cluster, _, _, r, _ = setup
    sub.expected_block_size = 16
    hb = cache_pb2.Heartbeat(replica_id="a", address="h:1", cache=common_pb2.CacheState(block_size=32))
    r.set(KEYS.heartbeat("a"), hb.SerializeToString())
    with caplog.at_level("WARNING", logger="unicache.router.subscriber"):
        await sub.scan_heartbeats()
        await sub.scan_heartbeats()
    msgs = [rec.getMessage() for rec in caplog.records if "block size" in rec.getMessage()]
    assert msgs == ["replica a uses block size 32 but the router 16: no prefix will match"]


async def test_password_protected_redis():
    from unicache.redis_server import EmbeddedRedis

    server = EmbeddedRedis(password="pw-123")
    server.start()
    try:
        cluster = ClusterView(RecordingPolicy(), LocalityIndex())
        plain_url = f"redis://127.0.0.1:{server.port}/0"
        r = redis.Redis.from_url(server.url, socket_timeout=2)
        put_heartbeat(r, "a")
        put_summary(r, "a", 1, 0, [1])
        sub = RedisSubscriber(cluster, plain_url, KEYS.prefix, password="pw-123", heartbeat_interval_s=0.0)
        await sub.step(block_ms=0)
        assert list(cluster.replicas) == ["a"] and held(cluster.index, "a") == [1]
        await sub.close()
        bad = RedisSubscriber(ClusterView(RecordingPolicy(), LocalityIndex()), plain_url, KEYS.prefix, password="wrong")
        with pytest.raises(REDIS_ERRORS):
            await bad.step(block_ms=0)
        assert bad.cluster.redis_connected is False
        await bad.close()
        r.close()
    finally:
        server.close()


@given(
    ops=st.lists(
        st.tuples(
            st.sets(st.integers(0, 30), max_size=4),  # stored
            st.sets(st.integers(0, 30), max_size=4),  # removed
            st.booleans(),  # batch lost on the way to Redis
            st.booleans(),  # replica writes a fresh summary after this batch
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_index_is_exact_or_flagged_under_lost_batches(redis_server, ops):
    """Model check: after every step the index is flagged for resync or equals the
    replica's true holdings as of the batch it last applied (a lost *last* batch is only
    visible once a later one arrives); once a fresh summary exists it is exact again."""
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    r.flushall()
    cluster = ClusterView(RecordingPolicy(), LocalityIndex())
    sub = RedisSubscriber(cluster, redis_server.url, KEYS.prefix, heartbeat_interval_s=0.0, resync_retry_s=0.0)
    try:
        truth: set[int] = set()
        truth_at: list[list[int]] = [[]]
        put_heartbeat(r, "a")
        put_summary(r, "a", 1, 0, [])
        for seq, (stored, removed, lost, summarize) in enumerate(ops, start=1):
            truth = (truth - removed) | stored
            truth_at.append(sorted(truth))
            if not lost:
                add_events(r, "a", 1, seq, stored=sorted(stored), removed=sorted(removed))
            if summarize:
                put_summary(r, "a", 1, seq, sorted(truth))
            await sub.step(block_ms=0)
            h = cluster.index.holdings("a")
            assert cluster.index.needs_resync("a") or held(cluster.index, "a") == truth_at[h.applied_seq]
        # A silently lost last batch shows only when the next one arrives: the replica
        # keeps publishing (seq n+1) and has a fresh summary (seq n) by then.
        n = len(ops)
        put_summary(r, "a", 1, n, sorted(truth))
        truth.add(99)
        add_events(r, "a", 1, n + 1, stored=[99])
        await sub.step(block_ms=0)
        await sub.step(block_ms=0)
        assert not cluster.index.needs_resync("a")
        assert held(cluster.index, "a") == sorted(truth)
    finally:
        await sub.close()
        r.close()
