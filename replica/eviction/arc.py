"""ARC (Megiddo and Modha, FAST 2003) over the evictable blocks.

Cached blocks are in T1 (used by one request since they were cached) or T2 (used again:
a hit, or cached again while remembered as a ghost). Evicted hashes are remembered in
ghost lists B1 (left from T1) and B2 (from T2). Caching a B1 ghost means T1 was too small:
the target size p of T1 grows; a B2 ghost shrinks it. A victim comes from T1 while T1
holds more than p blocks (or T2 has no candidate), else from T2; in each list the least
recently released candidate goes first, so of one request the tail goes first.

Prefix-aware: T1 and T2 count every cached block, but only unreferenced ones (released,
not hit since) are candidates. The policy is not told the cache size: c is the most
blocks it has seen cached at once (at eviction time the cache is full, so it is the
capacity).

Invariants:
    * ``_in_t2`` is a subset of the cached blocks ``_hash``; |T1| = len(_hash) - len(_in_t2).
    * A candidate is in exactly one of ``_c1`` (T1) and ``_c2`` (T2), oldest release first.
    * 0 <= p <= c, |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c after each eviction.
    * Every operation is O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.registry import register_policy


@register_policy("arc")
class ARCPolicy(EvictionPolicy):
    """Adaptive replacement between recency (T1) and frequency (T2); see the module docstring."""

    def __init__(self) -> None:
        self._hash: dict[int, BlockHash] = {}
        self._in_t2: set[int] = set()
        self._c1: OrderedDict[int, None] = OrderedDict()
        self._c2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self.p = 0.0
        self.c = 0

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._hash[block_id] = block_hash
        if len(self._hash) > self.c:
            self.c = len(self._hash)
        b1, b2 = self._b1, self._b2
        if block_hash in b1:
            self.p = min(float(self.c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[block_hash]
            self._in_t2.add(block_id)
        elif block_hash in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[block_hash]
            self._in_t2.add(block_id)

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        (self._c2 if block_id in self._in_t2 else self._c1)[block_id] = None

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._c1.pop(block_id, None)
        self._c2.pop(block_id, None)
        if block_id in self._hash:
            self._in_t2.add(block_id)  # used again: frequency side

    def pop_victim(self) -> int | None:
        c1, c2 = self._c1, self._c2
        if not c1 and not c2:
            return None
        t1 = len(self._hash) - len(self._in_t2)
        if c1 and (t1 > self.p or not c2):
            block_id = c1.popitem(last=False)[0]
            ghosts = self._b1
        else:
            block_id = c2.popitem(last=False)[0]
            ghosts = self._b2
        ghosts[self._forget(block_id)] = None
        self._trim_ghosts()
        return block_id

    def on_removed(self, block_id: int) -> None:
        if block_id in self._hash:
            self._c1.pop(block_id, None)
            self._c2.pop(block_id, None)
            self._forget(block_id)

    def __len__(self) -> int:
        return len(self._c1) + len(self._c2)

    def queue_sizes(self) -> dict[str, int]:
        return {"t1": len(self._c1), "t2": len(self._c2)}

    def _forget(self, block_id: int) -> BlockHash:
        self._in_t2.discard(block_id)
        return self._hash.pop(block_id)

    def _trim_ghosts(self) -> None:
        c, b1, b2 = self.c, self._b1, self._b2
        t1 = len(self._hash) - len(self._in_t2)
        while b1 and t1 + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(self._hash) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)
