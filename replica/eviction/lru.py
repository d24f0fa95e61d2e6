"""vLLM's eviction order: least recently released first; within one request, tail first.

The store releases a request's blocks tail first, so appending in release order puts a
request's tail ahead of its head, as vLLM's free-block queue does.
"""

from __future__ import annotations

from collections import OrderedDict

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.registry import register_policy


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """OrderedDict (a C linked hash map) as the O(1) LRU queue of candidates, oldest first."""

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        pass

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        self._queue[block_id] = None

    def on_release_many(
        self,
        block_ids: list[int],
        positions: list[int],
        cls: RequestClass,
        num_blocks: int,
        num_prompt_blocks: int,
        now: float,
    ) -> None:
        # The same appends as on_release per block, in order, done in C.
        self._queue.update(dict.fromkeys(block_ids))

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._queue.pop(block_id, None)

    def pop_victim(self) -> int | None:
        if not self._queue:
            return None
        return self._queue.popitem(last=False)[0]

    def on_removed(self, block_id: int) -> None:
        self._queue.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._queue)

    def order(self) -> list[int]:
        """Candidates in eviction order (tests)."""
        return list(self._queue)
