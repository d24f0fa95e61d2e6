"""A ``CacheSource`` over a bare ``KVStore`` (no model): lets the publisher publish a
metadata-only store's holdings, e.g. for the event-latency benchmark and publisher tests
that need exact control over which blocks are stored and removed."""

from __future__ import annotations

import threading

from unicache.replica.engines.api import CacheStateInfo, EngineLoad
from unicache.replica.kv.locked_reads import LockedStoreReads
from unicache.replica.kv.store import KVStore


class StoreCacheSource(LockedStoreReads):
    """Wraps a ``KVStore``; ``lock`` guards the store when another thread mutates it."""

    def __init__(self, store: KVStore, device: str = "meta"):
        self.store = store
        self.device = device
        self.block_size = store.block_size
        self.lock = threading.Lock()

    def load(self) -> EngineLoad:
        return EngineLoad(running=0, waiting=0, queued_prefill_tokens=0)

    def cache_state(self) -> CacheStateInfo:
        s = self.store
        with self.lock:
            return CacheStateInfo.of_store(s, s.policy.name, s.host.policy.name if s.host is not None else "")
