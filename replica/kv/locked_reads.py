"""``LockedStoreReads``: the snapshot reads of a ``KVStore`` that another thread mutates.

Mixed into whatever owns a store and the lock guarding it (the built-in engine, the
test harness ``unicache.testing.store_source``): each read takes ``self.lock`` and
returns a copy, so the publisher and the servicer never see the store mid-step.
"""

from __future__ import annotations

import threading

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_events import KVEvent
from unicache.replica.kv.store import KVStore


class LockedStoreReads:
    """Needs ``self.store`` (a ``KVStore``) and ``self.lock`` (guarding it)."""

    store: KVStore
    lock: threading.Lock

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
