"""FIFO eviction: the candidate that entered the queue first goes first; hits never move it.

A block enters the queue when it first becomes evictable (its first release). The store
releases a request's blocks tail first, so of one request the tail goes first, as with
lru; a block hit and released again goes back to its original place.

Invariants:
    * ``_seq[b]`` is set at a cached block's first release and kept until it leaves the
      cache, so queue order never changes while a block stays cached.
    * Candidates live in a ``KeyedCandidates`` heap keyed by ``_seq`` (O(log n)
      amortised, bounded by compaction).
"""

from __future__ import annotations

import itertools

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.candidates import KeyedCandidates
from unicache.replica.eviction.registry import register_policy


@register_policy("fifo")
class FIFOPolicy(EvictionPolicy):
    """First released, first evicted; hits do not refresh a block's place."""

    def __init__(self) -> None:
        self._seq: dict[int, int] = {}
        self._next = itertools.count()
        self._candidates = KeyedCandidates()

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        pass

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        seq = self._seq.get(block_id)
        if seq is None:
            seq = self._seq[block_id] = next(self._next)
        self._candidates.push(block_id, seq)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._candidates.discard(block_id)

    def pop_victim(self) -> int | None:
        top = self._candidates.pop()
        if top is None:
            return None
        del self._seq[top[1]]
        return top[1]

    def on_removed(self, block_id: int) -> None:
        self._candidates.discard(block_id)
        self._seq.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._candidates)

    def order(self) -> list[int]:
        """Candidates in eviction order (tests)."""
        return self._candidates.order()
