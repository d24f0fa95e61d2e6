"""The Redis subscriber against a real redis-server on a free port: events, gaps, epochs,
Redis outages and heartbeat expiry. Payloads are written into Redis directly as the
replicas' publisher would (sealed protobuf, keys from unicache.contract.redis_keys); a
``ReplicaTruth`` answers for the replicas' GetCacheSummary (resyncs come from them)."""

from __future__ import annotations

import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import BlockHash
from unicache.contract.redis_keys import RedisKeys
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.subscriber import REDIS_ERRORS, RedisSubscriber
from unicache.router.cluster.view import ClusterView, EmptyView
from unicache.router.routing.base import RoutingPolicy
from unicache.testing.signed_state import SIGNER, ReplicaTruth, sealed
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


_HB_SEQ: dict[str, int] = {}


def heartbeat(rid: str, epoch: int = 1, port: int = 7000, capacity: int = 100) -> cache_pb2.Heartbeat:
    """A replica's next heartbeat (its seq advances on every call, as a publisher's does)."""
    _HB_SEQ[rid] = _HB_SEQ.get(rid, 0) + 1
    return cache_pb2.Heartbeat(
        replica_id=rid, address=f"127.0.0.1:{port}", device="cpu", running=2, waiting=1, epoch=epoch,
        cache=common_pb2.CacheState(replica_id=rid, capacity_blocks=capacity, used_blocks=10, free_blocks=90, hit_ratio=0.5),
        timestamp=time.time(), seq=_HB_SEQ[rid],
    )


def put_heartbeat(r: redis.Redis, rid: str, epoch: int = 1, port: int = 7000, ttl_s: int = 30, capacity: int = 100) -> None:
    r.set(KEYS.heartbeat(rid), sealed("hb", heartbeat(rid, epoch, port, capacity)), ex=ttl_s)


def add_events(r: redis.Redis, rid: str, epoch: int, seq: int, stored=(), removed=(), cleared=False, parents=()) -> None:
    """``parents``: block numbers parallel to ``stored`` (0: a first block), or () as an
    old sender writes it."""
    b = cache_pb2.KVEventBatch(
        replica_id=rid, epoch=epoch, seq=seq, stored=[h(i) for i in stored], removed=[h(i) for i in removed], cleared=cleared,
        stored_parents=[h(p) if p else b"" for p in parents],
    )
    r.xadd(KEYS.events(rid), {"b": sealed("events", b)})


def replica_has(truth: ReplicaTruth, rid: str, epoch: int, seq: int, blocks: list[int], port: int = 7000) -> None:
    """What the replica's GetCacheSummary answers: holdings ``blocks`` as of (epoch, seq)."""
    truth.set(f"127.0.0.1:{port}", rid, epoch, seq, [h(i) for i in blocks])


def held(index: LocalityIndex, rid: str) -> list[int]:
    return sorted(int.from_bytes(b, "little") for b in index.holdings(rid).blocks)


@pytest.fixture
async def setup(redis_server):
    policy = RecordingPolicy()
    index = LocalityIndex(max_blocks_per_replica=1000)
    cluster = ClusterView(policy, index)
    clock = FakeClock()
    truth = ReplicaTruth()
    sub = RedisSubscriber(
        cluster, redis_server.url, KEYS.prefix, timeout_s=2.0, heartbeat_interval_s=0.0, resync_retry_s=0.0,
        reconnect_grace_s=3.0, clock=clock, signer=SIGNER, fetch_summary=truth.fetch,
    )
    sub.truth = truth
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    yield sub, cluster, index, policy, r, clock
    await sub.close()
    r.close()


async def test_summary_then_events_then_gap_resync(setup):
    sub, cluster, index, policy, r, _ = setup
    put_heartbeat(r, "a")
    add_events(r, "a", 1, 1, stored=[1])            # folded into the summary already
    add_events(r, "a", 1, 2, stored=[2])            # folded too
    replica_has(sub.truth, "a", 1, 2, [1, 2])
    add_events(r, "a", 1, 3, stored=[3, 4])
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"]
    assert cluster.replicas["a"].address == "127.0.0.1:7000"
    assert policy.calls == [("update", ("a",))]
    assert held(index, "a") == [1, 2, 3, 4]
    assert index.holdings("a").applied_seq == 3 and not index.needs_resync("a")
    assert cluster.redis_connected
    assert sub.truth.calls == [("127.0.0.1:7000", "a")]

    add_events(r, "a", 1, 4, stored=[5], removed=[1])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4, 5]

    # seq 5 is lost: seq 6 is a gap -> resync from the replica itself.
    add_events(r, "a", 1, 6, stored=[7])
    await sub.step(block_ms=0)
    assert index.needs_resync("a") and sub.rejections.counts["gap"] == 1
    replica_has(sub.truth, "a", 1, 6, [2, 3, 4, 5, 6, 7])
    await sub.step(block_ms=0)
    assert not index.needs_resync("a")
    assert held(index, "a") == [2, 3, 4, 5, 6, 7]
    assert len(sub.truth.calls) == 2
    add_events(r, "a", 1, 7, removed=[2])
    await sub.step(block_ms=0)
    assert held(index, "a") == [3, 4, 5, 6, 7]
    assert sub.rejections.total() == 1


async def test_epoch_change_resyncs_from_the_replica(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a", epoch=1)
    replica_has(sub.truth, "a", 1, 0, [1, 2, 3])
    await sub.step(block_ms=0)
    assert held(index, "a") == [1, 2, 3]
    # The replica restarted: new epoch, empty cache, new events.
    put_heartbeat(r, "a", epoch=2)
    replica_has(sub.truth, "a", 2, 0, [])
    add_events(r, "a", 2, 1, stored=[9])
    await sub.step(block_ms=0)
    assert index.holdings("a").epoch == 2
    assert held(index, "a") == [9]


async def test_a_heartbeat_from_before_the_resync_leaves_the_new_epoch_in_sync(setup):
    """The replica resynced (epoch 2 in its stream and summary) after writing its last
    heartbeat (epoch 1): scans that read that heartbeat again keep the index in sync; a
    heartbeat naming a newer epoch marks it stale."""
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a", epoch=1)
    replica_has(sub.truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    replica_has(sub.truth, "a", 2, 0, [5])
    add_events(r, "a", 2, 1, stored=[6])  # a batch of the new epoch: resync
    await sub.step(block_ms=0)
    await sub.step(block_ms=0)
    assert (index.holdings("a").epoch, held(index, "a"), index.needs_resync("a")) == (2, [5, 6], False)
    for _ in range(3):  # the epoch-1 heartbeat is read again by every scan
        await sub.step(block_ms=0)
        assert not index.needs_resync("a")
    assert len(sub.truth.calls) == 2
    put_heartbeat(r, "a", epoch=3)
    await sub.scan_heartbeats()
    assert index.needs_resync("a")


async def test_new_replica_added_and_expired_replica_dropped(setup):
    sub, cluster, index, policy, r, _ = setup
    put_heartbeat(r, "a")
    replica_has(sub.truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    put_heartbeat(r, "b", port=7001)
    replica_has(sub.truth, "b", 1, 0, [5, 6], port=7001)
    await sub.step(block_ms=0)
    assert sorted(cluster.replicas) == ["a", "b"]
    assert held(index, "b") == [5, 6]
    r.delete(KEYS.heartbeat("a"))  # what TTL expiry does
    sub.truth.forget("127.0.0.1:7000")  # after the replica died: nothing answers as it
    await sub.step(block_ms=0)
    assert sorted(cluster.replicas) == ["b"]
    assert index.replicas() == ["b"]
    assert policy.calls == [("update", ("a",)), ("update", ("a", "b")), ("died", "a"), ("update", ("b",))]
    assert [l.replica_id for l in cluster.loads()] == ["b"]
    assert (cluster.loads()[0].running, cluster.loads()[0].waiting, cluster.loads()[0].free_blocks) == (2, 1, 90)


async def test_unreachable_new_replica_is_not_admitted_until_it_answers(setup):
    sub, cluster, _, _, r, _ = setup
    put_heartbeat(r, "a")
    await sub.step(block_ms=0)  # nobody answers at 127.0.0.1:7000
    assert list(cluster.replicas) == []
    replica_has(sub.truth, "a", 1, 0, [4])
    put_heartbeat(r, "a")
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"] and held(cluster.index, "a") == [4]


async def test_redis_outage_keeps_replicas_then_rebuilds(setup, redis_server):
    sub, cluster, index, _, r, clock = setup
    put_heartbeat(r, "a")
    replica_has(sub.truth, "a", 1, 0, [1, 2])
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
    replica_has(sub.truth, "a", 1, 5, [2, 3])
    await sub.step(block_ms=0)
    assert cluster.redis_connected and sub.reconnects == 1
    assert list(cluster.replicas) == ["a"]  # no heartbeat yet, but inside the grace period
    assert held(index, "a") == [2, 3]       # rebuilt from the replica itself
    # The replica republishes its heartbeat and keeps publishing events.
    r2 = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    put_heartbeat(r2, "a")
    add_events(r2, "a", 1, 6, stored=[4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4] and not index.needs_resync("a")
    # After the grace period a replica without heartbeat (and gone) is dropped.
    r2.delete(KEYS.heartbeat("a"))
    sub.truth.forget("127.0.0.1:7000")
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
    replica_has(sub.truth, "a", 2, 4, [1, 2, 3, 4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [1, 2, 3, 4, 5, 6, 7]
    assert index.holdings("a").applied_seq == 7 and not index.needs_resync("a")
    # Live events continue from the newest entry.
    add_events(r, "a", 2, 8, removed=[1])
    await sub.step(block_ms=0)
    assert held(index, "a") == [2, 3, 4, 5, 6, 7]


async def test_summary_older_than_trimmed_stream_is_fetched_again(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    for seq in (5, 6):  # batches 1..4 were trimmed away
        add_events(r, "a", 1, seq, stored=[seq])
    replica_has(sub.truth, "a", 1, 2, [1, 2])
    await sub.step(block_ms=0)
    assert index.needs_resync("a") and len(sub.truth.calls) == 1
    replica_has(sub.truth, "a", 1, 6, [1, 2, 5, 6])
    await sub.step(block_ms=0)
    assert not index.needs_resync("a") and held(index, "a") == [1, 2, 5, 6]
    assert len(sub.truth.calls) == 2


async def test_corrupt_payloads_do_not_stop_the_subscriber(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    r.set(KEYS.heartbeat("junk"), b"\xff\xff")
    replica_has(sub.truth, "a", 1, 0, [3])
    r.xadd(KEYS.events("a"), {"b": b"\xff\xff"})
    r.xadd(KEYS.events("a"), {"other": b"x"})
    await sub.step(block_ms=0)
    assert list(cluster.replicas) == ["a"]
    add_events(r, "a", 1, 1, stored=[4])
    await sub.step(block_ms=0)
    assert held(index, "a") == [3, 4]
    # the junk heartbeat on each of the two scans, and the corrupt batch; the entry
    # without a payload field is unparsable
    assert sub.rejections.counts["bad_mac"] == 3 and sub.rejections.counts["unparsable"] == 1


async def test_block_size_mismatch_is_logged_once(setup, caplog):
    sub, cluster, _, _, r, _ = setup
    sub.expected_block_size = 16
    hb = heartbeat("a")
    hb.cache.block_size = 32
    r.set(KEYS.heartbeat("a"), sealed("hb", hb))
    with caplog.at_level("WARNING", logger="unicache.router.cluster.subscriber"):
        await sub.scan_heartbeats()
        await sub.scan_heartbeats()
    msgs = [rec.getMessage() for rec in caplog.records if "block size" in rec.getMessage()]
    assert msgs == ["replica a uses block size 32 but the router 16: no prefix will match"]


async def test_password_protected_redis():
    from unicache.plumbing.redis_server import EmbeddedRedis

    server = EmbeddedRedis(password="pw-123")
    server.start()
    try:
        cluster = ClusterView(RecordingPolicy(), LocalityIndex())
        truth = ReplicaTruth()
        r = redis.Redis.from_url(server.url, socket_timeout=2)
        put_heartbeat(r, "a")
        replica_has(truth, "a", 1, 0, [1])
        sub = RedisSubscriber(
            cluster, server.plain_url, KEYS.prefix, password="pw-123", heartbeat_interval_s=0.0,
            signer=SIGNER, fetch_summary=truth.fetch,
        )
        await sub.step(block_ms=0)
        assert list(cluster.replicas) == ["a"] and held(cluster.index, "a") == [1]
        await sub.close()
        bad = RedisSubscriber(
            ClusterView(RecordingPolicy(), LocalityIndex()), server.plain_url, KEYS.prefix, password="wrong",
            signer=SIGNER, fetch_summary=truth.fetch,
        )
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
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_index_is_exact_or_flagged_under_lost_batches(redis_server, ops):
    """Model check: after every step the index is flagged for resync or equals the
    replica's true holdings as of the batch it last applied (a lost *last* batch is only
    visible once a later one arrives); a resync (from the replica) makes it exact again."""
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    r.flushall()
    cluster = ClusterView(RecordingPolicy(), LocalityIndex())
    truth = ReplicaTruth()
    sub = RedisSubscriber(
        cluster, redis_server.url, KEYS.prefix, heartbeat_interval_s=0.0, resync_retry_s=0.0,
        signer=SIGNER, fetch_summary=truth.fetch,
    )
    try:
        held_now: set[int] = set()
        truth_at: list[list[int]] = [[]]
        put_heartbeat(r, "a")
        replica_has(truth, "a", 1, 0, [])
        for seq, (stored, removed, lost) in enumerate(ops, start=1):
            held_now = (held_now - removed) | stored
            truth_at.append(sorted(held_now))
            replica_has(truth, "a", 1, seq, sorted(held_now))
            if not lost:
                add_events(r, "a", 1, seq, stored=sorted(stored), removed=sorted(removed))
            await sub.step(block_ms=0)
            h = cluster.index.holdings("a")
            assert cluster.index.needs_resync("a") or held(cluster.index, "a") == truth_at[h.applied_seq]
        # A silently lost last batch shows only when the next one arrives.
        n = len(ops)
        held_now.add(99)
        add_events(r, "a", 1, n + 1, stored=[99])
        replica_has(truth, "a", 1, n + 1, sorted(held_now))
        await sub.step(block_ms=0)
        await sub.step(block_ms=0)
        assert not cluster.index.needs_resync("a")
        assert held(cluster.index, "a") == sorted(held_now)
    finally:
        await sub.close()
        r.close()


async def test_batches_carry_parents_into_the_index_and_a_mismatch_resyncs(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    replica_has(sub.truth, "a", 1, 0, [])
    add_events(r, "a", 1, 1, stored=[1, 2, 3], parents=[0, 1, 2])
    await sub.step(block_ms=0)
    blocks = index.holdings("a").blocks
    assert held(index, "a") == [1, 2, 3]
    assert [blocks[h(i)].children for i in (1, 2, 3)] == [1, 1, 0]
    assert blocks[h(3)].parent is blocks[h(2)] and blocks[h(1)].parent is None
    add_events(r, "a", 1, 2, stored=[4, 5], parents=[3])  # one parent for two blocks
    await sub.step(block_ms=0)
    assert index.needs_resync("a") and sub.rejections.counts["unparsable"] == 1
    assert held(index, "a") == [1, 2, 3]


async def test_a_summary_carries_the_chains_and_a_mismatch_is_refused(setup):
    sub, cluster, index, _, r, _ = setup
    put_heartbeat(r, "a")
    sub.truth.set("127.0.0.1:7000", "a", 1, 0, [h(1), h(2), h(3)], [None, h(1), h(2)])
    await sub.step(block_ms=0)
    blocks = index.holdings("a").blocks
    assert [blocks[h(i)].children for i in (1, 2, 3)] == [1, 1, 0]
    assert blocks[h(2)].parent is blocks[h(1)]
    put_heartbeat(r, "b", port=7001)
    sub.truth.set("127.0.0.1:7001", "b", 1, 0, [h(1), h(2)], [None])
    await sub.step(block_ms=0)
    assert index.needs_resync("b") and sub.rejections.counts["unparsable"] == 1


async def test_a_replica_whose_keys_vanish_stays_while_it_proves_itself(setup):
    """Deleted keys (not a dead replica): each scan asks the replica itself for a summary
    sealed over a fresh nonce; it stays, with its last beat's load, while it answers."""
    sub, cluster, index, policy, r, clock = setup
    put_heartbeat(r, "a")
    replica_has(sub.truth, "a", 1, 0, [1, 2])
    await sub.step(block_ms=0)
    calls = len(sub.truth.calls)
    for _ in range(3):
        r.delete(KEYS.heartbeat("a"), KEYS.summary("a"))
        clock.t += 5.0  # past the TTL of its last beat
        await sub.step(block_ms=0)
        assert list(cluster.replicas) == ["a"] and held(index, "a") == [1, 2]
    assert sub.kept_alive == 3 and len(sub.truth.calls) == calls + 3
    assert (cluster.loads()[0].running, cluster.loads()[0].free_blocks) == (2, 90)
    assert policy.calls == [("update", ("a",))]  # never left routing


async def test_a_replica_whose_keys_vanish_is_dropped_when_another_answers_at_its_address(setup):
    sub, cluster, index, policy, r, clock = setup
    put_heartbeat(r, "a")
    replica_has(sub.truth, "a", 1, 0, [1])
    await sub.step(block_ms=0)
    r.delete(KEYS.heartbeat("a"))
    replica_has(sub.truth, "b", 1, 0, [9])  # another replica (or a squatter with the key) at a's address
    await sub.step(block_ms=0)
    assert cluster.replicas == {} and index.replicas() == []
    assert sub.rejections.counts["wrong_replica"] == 1 and sub.kept_alive == 0
    assert policy.calls == [("update", ("a",)), ("died", "a"), ("update", ())]
