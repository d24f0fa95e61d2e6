"""LFU with dynamic aging (LFU-DA): the candidate with the lowest aged use count goes first.

A block's count is its uses since it was cached (its first request plus every hit). Its
key is L + count, where L, the cache age, is the key of the last victim: a block cached
now starts above every block that has not been used since L rose past its key, so old
popularity decays instead of pinning a once-hot block forever.

Ties go by release order; the store releases a request's blocks tail first and a prefix
block is used at least as often as the blocks after it, so of one request the tail goes
first.

Invariants:
    * ``_count[b]`` is set for every cached block, >= 1, and dropped when it leaves.
    * ``L`` never decreases (a victim is the lowest key, and keys are pushed >= L + 1).
    * Candidates live in a ``KeyedCandidates`` heap (O(log n), bounded by compaction).
"""

from __future__ import annotations

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.candidates import KeyedCandidates
from unicache.replica.eviction.registry import register_policy


@register_policy("lfu")
class LFUPolicy(EvictionPolicy):
    """Least (aged) frequently used first; see the module docstring."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._candidates = KeyedCandidates()
        self.cache_age = 0.0  # L

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._count[block_id] = 1

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        self._candidates.push(block_id, self.cache_age + self._count.get(block_id, 1))

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        if block_id in self._count:
            self._count[block_id] += 1
        self._candidates.discard(block_id)

    def pop_victim(self) -> int | None:
        top = self._candidates.pop()
        if top is None:
            return None
        key, block_id = top
        self.cache_age = key
        self._count.pop(block_id, None)
        return block_id

    def on_removed(self, block_id: int) -> None:
        self._candidates.discard(block_id)
        self._count.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._candidates)

    def order(self) -> list[int]:
        """Candidates in eviction order (tests)."""
        return self._candidates.order()
