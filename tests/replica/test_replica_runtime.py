"""A whole replica (real engine + gRPC server on port 0 + publisher) against a private
redis-server: the events of a request are exactly its prompt's block hashes, and when
Redis is killed the replica keeps serving, then republishes an exact summary in a new epoch.
"""

from __future__ import annotations


import grpc
import redis.asyncio as aioredis

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.redis_keys import RedisKeys
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, SIGNER, call_metadata
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc

BS = 8
KEYS = RedisKeys("rt")


async def generate(address: str, ids: list[int], max_tokens: int = 1) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = replica_pb2_grpc.ReplicaStub(ch)
        req = replica_pb2.GenerateRequest(
            token_ids=replica_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
        )
        return [t async for m in stub.Generate(req, timeout=60, metadata=call_metadata()) for t in m.token_ids]


async def summary(r) -> cache_pb2.CacheSummary | None:
    try:
        raw = await r.get(KEYS.summary("rt-0"))
    except (OSError, aioredis.RedisError):
        return None
    return cache_pb2.CacheSummary.FromString(SIGNER.open("summary", raw)) if raw else None


async def test_replica_publishes_exact_events_and_survives_a_redis_outage(redis_server):
    settings = ReplicaSettings(
        replica_id="rt-0", redis_url=redis_server.url, redis_prefix=KEYS.prefix, block_size=BS, num_blocks=64,
        eviction_policy="lru", device="cpu", cluster_key=CLUSTER_KEY, insecure_no_tls=True,
    )
    runtime = ReplicaRuntime(settings)
    address = await runtime.start()
    r = aioredis.Redis.from_url(redis_server.url, socket_timeout=2)
    try:
        first = await summary(r)
        assert (first.epoch, first.seq, list(first.block_hashes), first.block_size) == (runtime.publisher.epoch, 0, [], BS)
        p1 = list(range(1, 21))  # 2 full blocks + 4 tokens; max_tokens=1 feeds nothing back
        assert len(await generate(address, p1)) == 1
        await eventually(lambda: runtime.publisher.seq == 1)
        [(_, fields)] = await r.xrange(KEYS.events("rt-0"))
        batch = cache_pb2.KVEventBatch.FromString(SIGNER.open("events", fields[b"b"]))
        assert (batch.seq, list(batch.stored), list(batch.removed)) == (1, hash_token_blocks(p1, BS), [])

        redis_server.kill()
        await eventually(lambda: runtime.publisher.resync_needed)
        p2 = list(range(100, 125))  # 3 full blocks, stored while Redis is down
        assert len(await generate(address, p2, max_tokens=3)) == 3  # still serving
        assert runtime.engine.num_referenced_blocks() == 0
        old_epoch = runtime.publisher.epoch

        redis_server.start()
        await r.connection_pool.disconnect()
        s = await eventually(lambda: summary(r))
        want = hash_token_blocks(p1, BS) + hash_token_blocks(p2, BS)  # 25 + 2 fed-back tokens: 3 full blocks
        assert s.epoch > old_epoch and s.seq == 0
        assert sorted(s.block_hashes) == sorted(want) == sorted(runtime.engine.cached_hashes())
        hb = cache_pb2.Heartbeat.FromString(SIGNER.open("hb", await eventually(lambda: r.get(KEYS.heartbeat("rt-0")))))
        assert (hb.address, hb.device, hb.cache.cached_blocks) == (address, "cpu", 5)
    finally:
        await runtime.stop()
        await r.aclose()
