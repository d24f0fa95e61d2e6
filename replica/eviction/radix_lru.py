"""SGLang's radix-cache eviction: the least recently used *leaf* of the prefix tree first.

A cached block's parent is the cached block holding the previous prefix block (the store
passes it to ``on_cached``). A leaf is a cached block no other cached block names as
parent. Evicting leaves first never strands a cached suffix behind an evicted prefix.

Invariants:
    * ``_candidates`` holds exactly the evictable blocks (released, not re-accessed), in
      release order (a dict keeps insertion order; it doubles as the LRU fallback).
    * ``_children[b]`` is the set of cached blocks whose parent is ``b``; removing ``b``
      detaches them (their parent becomes -1), so a reused block id inherits nothing.
    * Every evictable leaf has exactly one live heap entry: the entry whose ``token``
      equals ``_token[b]``. Stale entries (re-accessed, gained a child, re-pushed) are
      skipped when popped (lazy invalidation), so each operation is O(log n); the heap
      is rebuilt from the live entries once it holds more than 2 x live + 64 entries
      (amortised O(1) per push), so its size stays bounded on a long-running replica.
    * If no evictable block is a leaf (a cached child pinned by a request that holds a
      private copy of its parent), the least recently released candidate goes instead,
      so ``pop_victim`` returns a block whenever ``len(self) > 0``.
"""

from __future__ import annotations

import heapq
import itertools

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.registry import register_policy


@register_policy("radix-lru")
class RadixLRUPolicy(EvictionPolicy):
    """Least recently used leaf first; ties broken by push order (older first)."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}
        self._last_use: dict[int, float] = {}
        self._candidates: dict[int, None] = {}
        self._token: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []  # (last_use, token, block_id)
        self._counter = itertools.count()

    # ----------------------------------------------------------------- hooks
    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._parent[block_id] = parent_id
        self._last_use[block_id] = now
        if parent_id >= 0:
            kids = self._children.get(parent_id)
            if kids is None:
                self._children[parent_id] = {block_id}
            else:
                kids.add(block_id)
            # The parent stops being a leaf; its heap entry (if any) goes stale.
            self._token.pop(parent_id, None)

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        self._candidates[block_id] = None
        self._last_use[block_id] = info.now
        if not self._children.get(block_id):
            self._push(block_id)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        if self._candidates.pop(block_id, 0) is None:
            self._token.pop(block_id, None)
        self._last_use[block_id] = now

    def pop_victim(self) -> int | None:
        if not self._candidates:
            return None
        heap, token = self._heap, self._token
        while heap:
            _, tok, block_id = heapq.heappop(heap)
            if token.get(block_id) == tok:
                self._remove(block_id)
                return block_id
        # No evictable leaf: fall back to the least recently released candidate.
        block_id = next(iter(self._candidates))
        self._remove(block_id)
        return block_id

    def on_removed(self, block_id: int) -> None:
        if block_id in self._parent:
            self._remove(block_id)

    def __len__(self) -> int:
        return len(self._candidates)

    # --------------------------------------------------------------- helpers
    def _push(self, block_id: int) -> None:
        tok = next(self._counter)
        token = self._token
        token[block_id] = tok
        heap = self._heap
        heapq.heappush(heap, (self._last_use[block_id], tok, block_id))
        if len(heap) > 2 * len(token) + 64:
            # NOTE: a re-accessed leaf leaves a stale entry; drop them all at once.
            self._heap = [e for e in heap if token.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _remove(self, block_id: int) -> None:
        """Forget a block leaving the cache; its parent may become an evictable leaf."""
        self._candidates.pop(block_id, None)
        self._token.pop(block_id, None)
        self._last_use.pop(block_id, None)
        for child in self._children.pop(block_id, ()):
            self._parent[child] = -1
        parent = self._parent.pop(block_id, -1)
        if parent >= 0:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(block_id)
                if not kids:
                    del self._children[parent]
                    if parent in self._candidates:
                        self._push(parent)

    def order(self) -> list[int]:
        """Candidates in the order they would be evicted (tests; destroys nothing)."""
        clone = RadixLRUPolicy()
        clone._parent = dict(self._parent)
        clone._children = {k: set(v) for k, v in self._children.items()}
        clone._last_use = dict(self._last_use)
        clone._candidates = dict(self._candidates)
        clone._token = dict(self._token)
        clone._heap = list(self._heap)
        clone._counter = itertools.count(next(self._counter))
        out = []
        while (victim := clone.pop_victim()) is not None:
            out.append(victim)
        return out
