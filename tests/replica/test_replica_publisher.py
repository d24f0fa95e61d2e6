"""CachePublisher against a private redis-server: exact batches, summaries, heartbeat,
the resync channel, and a Redis outage (kill + restart) while the replica keeps going.

The source is a real metadata-only KVStore (``StoreCacheSource``) so every stored and
removed hash is known exactly. Loops that would make timing matter are given huge
intervals and driven by explicit ``flush()`` calls, except in the outage test.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.kv_tier import Tier
from unicache.contract.redis_keys import RedisKeys
from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.registry import make_host_policy, make_policy
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.store import KVStore
from unicache.replica.publishing.event_batch import PendingBatch
from unicache.replica.publishing.publisher import CachePublisher
from unicache.router.cluster.index import LocalityIndex
from unicache.testing.polling import eventually
from unicache.testing.signed_state import SIGNER
from unicache.testing.store_source import StoreCacheSource
from unicache.v1 import cache_pb2

BS = 4
KEYS = RedisKeys("t")
SLOW = 3600.0  # a loop interval that never fires during a test


def make_source(num_blocks: int = 6) -> StoreCacheSource:
    return StoreCacheSource(KVStore(num_blocks, BS, make_policy("lru")), device="cpu")


def serve(src: StoreCacheSource, rid: str, tokens: list[int], now: float = 0.0) -> list[bytes]:
    """Run one request through the store: allocate, cache its full blocks, free."""
    store = src.store
    hashes = hash_token_blocks(tokens, BS)
    store.allocate(rid, hashes, len(tokens), SINGLE_TURN, now)
    store.cache_blocks(rid, now)
    store.free(rid, now)
    return hashes


def make_publisher(src, url, **kw) -> CachePublisher:
    args = dict(
        keys=KEYS, flush_interval_s=SLOW, heartbeat_interval_s=SLOW, summary_interval_s=SLOW, clock=lambda: 1000.0
    )
    args.update(kw)
    return CachePublisher(src, "r0", url, "127.0.0.1:5000", signer=SIGNER, **args)


async def read_batches(r, rid="r0") -> list[cache_pb2.KVEventBatch]:
    return [cache_pb2.KVEventBatch.FromString(SIGNER.open("events", f[b"b"])) for _, f in await r.xrange(KEYS.events(rid))]


async def read_summary(r, rid="r0") -> cache_pb2.CacheSummary | None:
    raw = await r.get(KEYS.summary(rid))
    return cache_pb2.CacheSummary.FromString(SIGNER.open("summary", raw)) if raw is not None else None


@pytest.fixture
async def redis_client(redis_server):
    r = aioredis.Redis.from_url(redis_server.url, socket_timeout=2.0)
    yield r
    await r.aclose()


# ----------------------------------------------------------------- pure batching
def test_pending_batch_keeps_net_effect():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    p = PendingBatch()
    p.add([BlockStored(a, None, 0), BlockStored(b, a, 0), BlockRemoved(a, 0), BlockRemoved(c, 0), BlockStored(c, b, 0)])
    assert (list(p.stored), list(p.removed), p.cleared) == ([b, c], [a], False)
    p.add([AllBlocksCleared(1), BlockStored(a, None, 1)])
    assert (list(p.stored), list(p.removed), p.cleared) == ([a], [], True)
    msg = p.to_proto("r", 7, 3, 1.5)
    assert (msg.epoch, msg.seq, list(msg.stored), list(msg.removed), msg.cleared) == (7, 3, [a], [], True)
    assert list(msg.stored_parents) == [b""]  # a first block
    p = PendingBatch()
    p.add([BlockStored(a, None, 0), BlockStored(b, a, 0), BlockStored(c, b, 0), BlockRemoved(b, 0)])
    msg = p.to_proto("r", 7, 4, 1.5)
    assert (list(msg.stored), list(msg.stored_parents), list(msg.removed)) == ([a, c], [b"", b], [b])


def test_pending_batch_keeps_each_tiers_net_effect():
    a, b = (bytes([i]) * 16 for i in (1, 2))
    p = PendingBatch()
    # a demoted then promoted back; b demoted.
    p.add([BlockStored(a, None, 0), BlockStored(b, a, 0), BlockRemoved(a, 0), BlockStored(a, None, 0, Tier.HOST),
           BlockRemoved(b, 0), BlockStored(b, a, 0, Tier.HOST), BlockRemoved(a, 1, Tier.HOST), BlockStored(a, None, 1)])
    msg = p.to_proto("r", 7, 3, 1.5)
    assert (list(msg.stored), list(msg.removed), list(msg.host_stored), list(msg.host_removed)) == ([a], [b], [b], [a])
    p.add([AllBlocksCleared(2)])
    assert p.to_proto("r", 7, 4, 2.0).host_stored == [] and not p.empty()


# ----------------------------------------------------------------- against Redis
async def test_start_writes_summary_and_heartbeat(redis_server, redis_client):
    src = make_source()
    h1 = serve(src, "a", list(range(9)))  # 2 full blocks, 1 partial (never cached)
    pub = make_publisher(src, redis_server.url, heartbeat_interval_s=0.05)
    await pub.start()
    try:
        s = await read_summary(redis_client)
        assert (s.replica_id, s.epoch, s.seq, list(s.block_hashes), s.block_size) == ("r0", 1_000_000, 0, h1, BS)
        assert list(s.parents) == [b"", h1[0]]  # the chain, so a router trims it from the tail
        await eventually(lambda: redis_client.exists(KEYS.heartbeat("r0")))
        ttl = await redis_client.pttl(KEYS.heartbeat("r0"))
        assert 0 < ttl <= 3000
        hb = cache_pb2.Heartbeat.FromString(SIGNER.open("hb", await redis_client.get(KEYS.heartbeat("r0"))))
        assert (hb.address, hb.device, hb.epoch, hb.running, hb.waiting) == ("127.0.0.1:5000", "cpu", 1_000_000, 0, 0)
        assert (hb.cache.capacity_blocks, hb.cache.free_blocks, hb.cache.cached_blocks) == (6, 6, 2)
        assert (hb.cache.block_size, hb.cache.eviction_policy, dict(hb.cache.queue_sizes)) == (BS, "lru", {"lru": 2})
        assert not await redis_client.exists(KEYS.events("r0"))
    finally:
        await pub.stop()
    assert not await redis_client.exists(KEYS.heartbeat("r0"))  # clean stop removes it at once


async def test_batches_have_consecutive_seq_and_exact_content(redis_server, redis_client):
    src = make_source(num_blocks=4)
    pub = make_publisher(src, redis_server.url)
    await pub.start()
    try:
        h1 = serve(src, "a", list(range(8)))
        assert await pub.flush()
        assert await pub.flush()  # nothing new: no batch
        h2 = serve(src, "b", [100 + t for t in range(8)])
        assert await pub.flush()
        # 4 blocks, all cached; a new 2-block prompt evicts LRU (a's tail first, then head).
        h3 = serve(src, "c", [200 + t for t in range(8)])
        assert await pub.flush()
        batches = await read_batches(redis_client)
        assert [(b.epoch, b.seq) for b in batches] == [(1_000_000, 1), (1_000_000, 2), (1_000_000, 3)]
        assert [list(b.stored) for b in batches] == [h1, h2, h3]
        assert [list(b.stored_parents) for b in batches] == [[b"", h1[0]], [b"", h2[0]], [b"", h3[0]]]
        assert [list(b.removed) for b in batches] == [[], [], [h1[1], h1[0]]]
        assert pub.seq == 3
    finally:
        await pub.stop()


async def test_summary_plus_stream_rebuild_the_store_in_a_locality_index(redis_server, redis_client):
    src = make_source(num_blocks=5)
    pub = make_publisher(src, redis_server.url)
    await pub.start()
    try:
        for i in range(12):
            serve(src, f"q{i}", [i % 4 * 50 + t for t in range(4 * (1 + i % 3))])
            await pub.flush()
            if i == 5:
                await pub.publish_summary()
        src.store.reset_cache(now=1.0)
        serve(src, "last", list(range(4)))
        await pub.flush()
        # A router that starts late: summary first, then every later batch of that epoch.
        s = await read_summary(redis_client)
        index = LocalityIndex()
        index.apply_summary("r0", s.epoch, s.seq, s.block_hashes)
        batches = await read_batches(redis_client)
        for b in batches:
            parents = [p or None for p in b.stored_parents]
            assert index.apply_events("r0", b.epoch, b.seq, b.stored, b.removed, b.cleared, parents)
        assert set(index.holdings("r0").blocks) == set(src.store.cached_hashes())
        # 13 of the 13 flushes had events (q4 repeats q0's one block: a pure hit, no batch).
        assert [b.seq for b in batches] == list(range(1, 14)) and s.seq == 6
    finally:
        await pub.stop()


async def test_summary_plus_stream_rebuild_both_tiers_in_a_locality_index(redis_server, redis_client):
    store = KVStore(5, BS, make_policy("lru"), host=HostTier(6, make_host_policy("unicache")))
    src = StoreCacheSource(store, device="cpu")
    pub = make_publisher(src, redis_server.url)
    await pub.start()
    try:
        for i in range(12):
            serve(src, f"q{i}", [i % 4 * 50 + t for t in range(4 * (1 + i % 3))])
            await pub.flush()
            if i == 5:
                await pub.publish_summary()
        assert store.host.stats.demotions and store.host.stats.hit_blocks  # both directions happened
        s = await read_summary(redis_client)
        index = LocalityIndex()
        index.apply_summary("r0", s.epoch, s.seq, s.block_hashes, host_hashes=s.host_block_hashes)
        for b in await read_batches(redis_client):
            assert index.apply_events("r0", b.epoch, b.seq, b.stored, b.removed, b.cleared,
                                      [p or None for p in b.stored_parents], host_stored=b.host_stored,
                                      host_removed=b.host_removed)
        assert set(index.holdings("r0").blocks) == set(store.cached_hashes())
        assert set(index.holdings("r0").host) == set(store.host_hashes())
        state = src.cache_state()
        assert (state.host.capacity_blocks, state.host.promotions) == (6, store.host.stats.hit_blocks)
    finally:
        await pub.stop()


async def test_resync_channel_triggers_summary(redis_server, redis_client):
    src = make_source()
    pub = make_publisher(src, redis_server.url)
    await pub.start()
    try:
        await eventually(lambda: _numsub(redis_client))
        h = serve(src, "a", list(range(8)))
        await redis_client.publish(KEYS.resync_channel(), "other-replica")
        await redis_client.publish(KEYS.resync_channel(), "r0")
        await eventually(lambda: pub.stats.summaries == 2)
        s = await read_summary(redis_client)
        assert (s.epoch, s.seq, list(s.block_hashes)) == (1_000_000, 1, h)
        assert [list(b.stored) for b in await read_batches(redis_client)] == [h]  # flushed first
    finally:
        await pub.stop()


async def _numsub(r) -> bool:
    return (await r.pubsub_numsub(KEYS.resync_channel()))[0][1] == 1


async def test_redis_outage_then_fresh_epoch_with_exact_summary(redis_server, redis_client):
    src = make_source(num_blocks=4)
    clock = iter(range(10**9))
    pub = make_publisher(
        src,
        redis_server.url,
        flush_interval_s=0.02,
        heartbeat_interval_s=0.05,
        retry_interval_s=0.02,
        op_timeout_s=0.3,
        clock=lambda: float(next(clock)),
    )
    await pub.start()
    try:
        h1 = serve(src, "a", list(range(8)))
        await eventually(lambda: pub.seq == 1)
        first_epoch = pub.epoch
        redis_server.kill()
        await eventually(lambda: pub.resync_needed)
        # The replica keeps working while Redis is down; these events are never published.
        h2 = serve(src, "b", [100 + t for t in range(8)])
        h3 = serve(src, "c", [200 + t for t in range(8)])  # evicts both of a's blocks
        await asyncio.sleep(0.1)
        assert pub.resync_needed
        redis_server.start()
        await redis_client.connection_pool.disconnect()
        await eventually(lambda: not pub.resync_needed)
        s = await read_summary(redis_client)
        assert s.epoch > first_epoch and s.seq == 0
        assert sorted(s.block_hashes) == sorted(h2 + h3) == sorted(src.store.cached_hashes())
        assert h1[0] not in s.block_hashes
        h4 = serve(src, "d", list(range(4)))
        await eventually(lambda: pub.seq == 1)
        batches = await read_batches(redis_client)
        assert [(b.epoch, b.seq, list(b.stored)) for b in batches] == [(s.epoch, 1, h4)]
        await eventually(lambda: redis_client.exists(KEYS.heartbeat("r0")))
    finally:
        await pub.stop()


def test_hot_path_records_use_slots():
    from unicache.replica.publishing.publisher import PublisherStats

    for obj in (PendingBatch(), PublisherStats()):
        assert not hasattr(obj, "__dict__"), type(obj).__name__
