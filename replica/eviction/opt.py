"""Offline Belady (OPT): evict the candidate whose next use lies furthest in the future.

Simulator only: it needs a ``FutureAccesses`` oracle built from the whole trace (which
request positions read each block hash). The simulator moves the oracle's clock to the
position of each request before the store admits it.

Invariants:
    * Each candidate has one live entry in ``_far`` (a max-heap on its next use, then on
      depth, so of a prefix and its extension with equal next use the deeper block goes
      first: a suffix is worthless without its prefix) and one in ``_due`` (a min-heap on
      the same next use). Entries whose ``token`` is not the block's current token are
      stale and skipped.
    * A stored next use ``k`` is exact while ``clock < k``. Before choosing, every entry
      with ``k <= clock`` is popped from ``_due`` and recomputed (its use passed without
      a hit, e.g. because a prefix block was missing), so ``_far``'s top is the true
      furthest. Each access refreshes a block at most once: O(log n) amortised.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.registry import register_policy

NEVER = float("inf")


class FutureAccesses:
    """Which request positions (0, 1, 2, ... in arrival order) read each block hash.

    Args:
        positions: hash -> ascending positions of the requests whose prompt holds it.

    ``clock`` is the position of the request being admitted; ``next_use`` answers the
    first position strictly after it.
    """

    def __init__(self, positions: Mapping[BlockHash, Sequence[int]]):
        self._positions = positions
        self.clock = -1

    @classmethod
    def from_prompts(cls, prompts: Iterable[Sequence[BlockHash]]) -> "FutureAccesses":
        """Build from every request's prompt block hashes, in arrival order."""
        positions: dict[BlockHash, list[int]] = {}
        for pos, hashes in enumerate(prompts):
            for h in hashes:
                lst = positions.get(h)
                if lst is None:
                    positions[h] = [pos]
                elif lst[-1] != pos:
                    lst.append(pos)
        return cls(positions)

    def next_use(self, block_hash: BlockHash) -> float:
        lst = self._positions.get(block_hash)
        if not lst:
            return NEVER
        i = bisect_right(lst, self.clock)
        return lst[i] if i < len(lst) else NEVER


@register_policy("opt")
class OptPolicy(EvictionPolicy):
    """Belady's furthest-next-use eviction over the evictable blocks.

    Args:
        future: the oracle; the simulator advances ``future.clock``.
    """

    def __init__(self, future: FutureAccesses):
        self.future = future
        self._hash: dict[int, BlockHash] = {}
        self._depth: dict[int, int] = {}
        self._token: dict[int, int] = {}  # candidates only
        self._far: list[tuple[float, int, int, int]] = []  # (-next_use, -depth, token, id)
        self._due: list[tuple[float, int, int]] = []  # (next_use, token, id)
        self._counter = itertools.count()

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._hash[block_id] = block_hash
        self._depth[block_id] = self._depth.get(parent_id, -1) + 1 if parent_id >= 0 else 0

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        self._push(block_id)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._token.pop(block_id, None)

    def pop_victim(self) -> int | None:
        if not self._token:
            return None
        clock, due, token = self.future.clock, self._due, self._token
        while due and due[0][0] <= clock:
            _, tok, block_id = heapq.heappop(due)
            if token.get(block_id) == tok:
                self._push(block_id)
        far = self._far
        while far:
            _, _, tok, block_id = heapq.heappop(far)
            if token.get(block_id) == tok:
                self._forget(block_id)
                return block_id
        raise AssertionError("opt: candidates without live heap entries")

    def on_removed(self, block_id: int) -> None:
        self._forget(block_id)

    def __len__(self) -> int:
        return len(self._token)

    def _push(self, block_id: int) -> None:
        tok = next(self._counter)
        self._token[block_id] = tok
        nxt = self.future.next_use(self._hash[block_id])
        heapq.heappush(self._far, (-nxt, -self._depth[block_id], tok, block_id))
        if nxt != NEVER:
            heapq.heappush(self._due, (nxt, tok, block_id))

    def _forget(self, block_id: int) -> None:
        self._token.pop(block_id, None)
        self._hash.pop(block_id, None)
        self._depth.pop(block_id, None)
