"""S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO and a ghost FIFO.

A block enters a queue at its first release (the store releases a request tail first,
so of one request the tail is ahead): the main queue M if its hash is a ghost (evicted
from the small queue recently), else the small queue S. Hits count up to 3 and never
move a block. Eviction: while S holds at least ``small_frac`` of the cache, its oldest
block leaves S: to M if it was hit since it entered, else out of the cache (its hash
joins the ghost queue). Otherwise M's oldest block goes if its count is 0; a block with
a count goes back to M's head with the count decremented (lazy promotion).

Prefix-aware: only unreferenced blocks are candidates. A referenced block met at S's
tail has been hit, so it moves to M as the rule says; one met at M's tail with count 0
is parked (out of M) and returns to M's head when released. The policy is not told the
cache size: c is the most blocks it has seen cached at once.

Invariants:
    * Every queued block is cached; it is in exactly one of ``_small``, ``_main`` or
      ``_parked`` (the last only while referenced).
    * A candidate is a queued block not in ``_referenced``; ``len(self)`` counts them.
    * The ghost queue holds at most c hashes, oldest dropped first.
    * Each block moves at most once per hit or reference between evictions (S to M, M
      head, parked), so every operation is O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.registry import register_policy

MAX_FREQ = 3


@register_policy("s3fifo")
class S3FIFOPolicy(EvictionPolicy):
    """Small + main + ghost FIFO queues; see the module docstring.

    Args:
        small_frac: the small queue's share of the cache (the paper's 10%).
    """

    def __init__(self, small_frac: float = 0.1):
        if not 0.0 < small_frac < 1.0:
            raise ValueError("small_frac must lie in (0, 1)")
        self.small_frac = small_frac
        self._hash: dict[int, BlockHash] = {}
        self._freq: dict[int, int] = {}
        self._ghost_hit: set[int] = set()  # cached blocks whose hash was a ghost
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._parked: set[int] = set()
        self._referenced: set[int] = set()  # queued blocks in use by a request
        self._ghosts: OrderedDict[BlockHash, None] = OrderedDict()
        self._candidates = 0
        self.c = 0

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._hash[block_id] = block_hash
        self._freq[block_id] = 0
        if len(self._hash) > self.c:
            self.c = len(self._hash)
        if self._ghosts.pop(block_hash, 0) is None:
            self._ghost_hit.add(block_id)

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        if block_id in self._referenced:
            self._referenced.discard(block_id)
            if block_id in self._parked:
                self._parked.discard(block_id)
                self._main[block_id] = None
        elif block_id in self._ghost_hit:
            self._ghost_hit.discard(block_id)
            self._main[block_id] = None
        else:
            self._small[block_id] = None
        self._candidates += 1

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        freq = self._freq.get(block_id)
        if freq is None:
            return
        if freq < MAX_FREQ:
            self._freq[block_id] = freq + 1
        if block_id not in self._referenced and (block_id in self._small or block_id in self._main):
            self._referenced.add(block_id)
            self._candidates -= 1

    def pop_victim(self) -> int | None:
        if not self._candidates:
            return None
        small, main, freq, referenced = self._small, self._main, self._freq, self._referenced
        while True:
            if small and (len(small) >= self.small_frac * self.c or not main):
                block_id = next(iter(small))
                del small[block_id]
                if block_id in referenced or freq[block_id] > 0:
                    freq[block_id] = 0
                    main[block_id] = None
                    continue
                self._ghosts[self._hash[block_id]] = None
                if len(self._ghosts) > self.c:
                    self._ghosts.popitem(last=False)
            else:
                block_id = next(iter(main))
                del main[block_id]
                if freq[block_id] > 0:
                    freq[block_id] -= 1
                    main[block_id] = None
                    continue
                if block_id in referenced:
                    self._parked.add(block_id)
                    continue
            self._candidates -= 1
            self._forget(block_id)
            return block_id

    def on_removed(self, block_id: int) -> None:
        if block_id not in self._hash:
            return
        queued = block_id in self._small or block_id in self._main or block_id in self._parked
        if queued and block_id not in self._referenced:
            self._candidates -= 1
        self._small.pop(block_id, None)
        self._main.pop(block_id, None)
        self._parked.discard(block_id)
        self._referenced.discard(block_id)
        self._forget(block_id)

    def __len__(self) -> int:
        return self._candidates

    def queue_sizes(self) -> dict[str, int]:
        """Candidates per queue. NOTE: O(referenced blocks), for cache-state reports only."""
        ref = self._referenced
        small = len(self._small) - sum(1 for b in ref if b in self._small)
        return {"small": small, "main": self._candidates - small}

    def _forget(self, block_id: int) -> None:
        del self._hash[block_id]
        del self._freq[block_id]
        self._ghost_hit.discard(block_id)
