"""Real replicas in-process for router end-to-end tests: an ``AsyncEngine`` with a tiny
seeded model, a ``ReplicaServer`` on port 0 and a ``CachePublisher`` to a private
redis-server (the caller's ``redis_server`` fixture). Faster to start than Ray actors
(``cluster_harness``), and every piece is the production one, signing with the test
cluster key (unicache/testing/signed_state.py) as ``ReplicaRuntime`` does."""

from __future__ import annotations

from unicache.contract.redis_keys import RedisKeys
from unicache.contract.state_auth import parse_cluster_key
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.replica.publishing.publisher import CachePublisher
from unicache.replica.serving.server import ReplicaServer
from unicache.testing.signed_state import CLUSTER_KEY


class RealReplica:
    """One replica ``rid`` publishing under ``prefix``; ``start``/``stop`` on the test's loop.

    Args:
        num_blocks / block_size / max_position: engine and model sizes (tiny by default).
        eviction_policy: the replica's eviction policy (default lru).
        flush_interval_s: how often its publisher writes its events (default 20 ms).
    """

    def __init__(self, rid: str, redis_url: str, prefix: str, *, block_size: int = 16, num_blocks: int = 64,
                 max_position: int = 512, eviction_policy: str = "lru", flush_interval_s: float = 0.02):
        model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            max_position=max_position)
        self.engine = AsyncEngine(EngineConfig(model=model, num_blocks=num_blocks, block_size=block_size,
                                               eviction_policy=eviction_policy, device="cpu"))
        self.rid, self.redis_url, self.prefix = rid, redis_url, prefix
        self.flush_interval_s = flush_interval_s

    async def start(self) -> None:
        await self.engine.start()
        self.server = ReplicaServer(self.engine, self.rid, cluster_key=parse_cluster_key(CLUSTER_KEY))
        port = await self.server.start()
        self.publisher = CachePublisher(
            self.engine, self.rid, self.redis_url, f"127.0.0.1:{port}", RedisKeys(self.prefix),
            flush_interval_s=self.flush_interval_s, heartbeat_interval_s=0.1, signer=self.server.signer,
        )
        self.server.servicer.summary_source = self.publisher.signed_summary
        await self.publisher.start()

    async def stop(self) -> None:
        await self.publisher.stop()
        await self.server.stop()
        await self.engine.stop()
