"""KV block records and the O(1) queue of uncached free blocks."""

from __future__ import annotations

from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.replica.eviction.base import ReleaseInfo


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV block.

    Invariants (checked by ``KVStore.check_invariants``):
        * ``ref_cnt >= 0``.
        * ``block_hash is None`` <=> the block is not in the prefix cache.
        * A block with ``ref_cnt > 0`` is in no free structure; a block with
          ``ref_cnt == 0`` is either in the uncached free queue (no hash) or held by the
          eviction policy as a candidate (has a hash), never both.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_id: int = -1
    # The parent's hash when the block was cached (kept for a demotion's event).
    parent_hash: BlockHash | None = None
    # The block's last release (class, position, time), kept only under a host tier: a
    # demoted block joins the host tier's policy with it.
    release: ReleaseInfo | None = None
    # Intrusive links of the uncached free queue.
    prev: "KVBlock | None" = None
    next: "KVBlock | None" = None
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of uncached free blocks with sentinels; every operation O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} already free"
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        block.in_free_queue = True
        self.size += 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue
        assert block.prev is not None and block.next is not None
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.size -= 1

    def ids(self) -> list[int]:
        """Block ids front to back (tests and debugging)."""
        out, node = [], self._head.next
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next
        return out
