"""A ``CacheSource`` over a bare ``KVStore`` (no model): lets the publisher publish a
metadata-only store's holdings, e.g. for the event-latency benchmark and publisher tests
that need exact control over which blocks are stored and removed."""

from __future__ import annotations

import threading

from unicache.block_hash import BlockHash
from unicache.replica.engine.api import CacheStateInfo, EngineLoad, HostTierInfo
from unicache.replica.kv.events import KVEvent
from unicache.replica.kv.store import KVStore


class StoreCacheSource:
    """Wraps a ``KVStore``; ``lock`` guards the store when another thread mutates it."""

    def __init__(self, store: KVStore, device: str = "meta"):
        self.store = store
        self.device = device
        self.block_size = store.block_size
        self.lock = threading.Lock()

    def take_events(self) -> list[KVEvent]:
        with self.lock:
            return self.store.take_events()

    def cached_hashes(self) -> list[BlockHash]:
        with self.lock:
            return self.store.cached_hashes()

    def host_hashes(self) -> list[BlockHash]:
        with self.lock:
            return self.store.host_hashes()

    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        with self.lock:
            return self.store.cached_blocks()

    def load(self) -> EngineLoad:
        return EngineLoad(running=0, waiting=0, queued_prefill_tokens=0)

    def cache_state(self) -> CacheStateInfo:
        s = self.store
        with self.lock:
            return CacheStateInfo(
                block_size=s.block_size,
                capacity_blocks=s.num_blocks,
                used_blocks=s.num_used_blocks,
                free_blocks=s.num_free_blocks,
                cached_blocks=s.num_cached_blocks,
                hit_ratio=s.stats.hit_ratio,
                queue_sizes=s.policy.queue_sizes(),
                eviction_policy=s.policy.name,
                evictions=s.stats.evictions,
                host=HostTierInfo.of_store(s, s.host.policy.name if s.host is not None else ""),
            )
