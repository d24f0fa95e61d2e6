"""A min-heap of eviction candidates with O(1) lazy removal, shared by the keyed policies."""

from __future__ import annotations

import heapq
import itertools


class KeyedCandidates:
    """Candidates ordered by a key, lowest first (ties: push order), with lazy removal.

    Invariants: ``token[b]`` is set iff ``b`` is a candidate, and the heap holds exactly
    one entry ``(key, token[b], b)`` for it; the heap is rebuilt from its live entries
    once it exceeds 2 x live + 64 entries.
    """

    __slots__ = ("heap", "token", "_counter")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int]] = []
        self.token: dict[int, int] = {}
        self._counter = itertools.count()

    def push(self, block_id: int, key: float) -> None:
        tok = next(self._counter)
        self.token[block_id] = tok
        heap = self.heap
        heapq.heappush(heap, (key, tok, block_id))
        if len(heap) > 2 * len(self.token) + 64:
            token = self.token
            self.heap = [e for e in heap if token.get(e[2]) == e[1]]
            heapq.heapify(self.heap)

    def discard(self, block_id: int) -> None:
        self.token.pop(block_id, None)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.token

    def __len__(self) -> int:
        return len(self.token)

    def peek(self) -> tuple[float, int] | None:
        """(key, block id) of the lowest candidate, or None."""
        heap, token = self.heap, self.token
        while heap:
            key, tok, block_id = heap[0]
            if token.get(block_id) == tok:
                return key, block_id
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[float, int] | None:
        """Remove and return (key, block id) of the lowest candidate, or None."""
        top = self.peek()
        if top is not None:
            heapq.heappop(self.heap)
            del self.token[top[1]]
        return top

    def order(self) -> list[int]:
        """Candidates lowest first (tests)."""
        return [b for _, _, b in sorted(e for e in self.heap if self.token.get(e[2]) == e[1])]
