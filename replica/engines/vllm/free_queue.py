"""``PolicyFreeQueue``: vLLM's free-block queue with its eviction order taken from our policy.

vLLM's ``BlockPool`` keeps every free block -- never-cached ones and evictable cached ones --
in one LRU linked list (``FreeKVCacheBlockQueue``) and has no hook for another order. This
class offers the same methods (``popleft``, ``popleft_n``, ``remove``, ``append``,
``append_n``, ``prepend_n``, ``get_all_free_blocks``, ``num_free_blocks``) and replaces the
pool's queue (replica/engines/vllm/scheduler.py installs it), so the order of victims comes
from an eviction policy of our registry (``lru``, ``unicache``, ...), the same objects the
built-in engine and the simulator run.

Victims still leave through vLLM's own path: ``BlockPool.get_new_blocks`` pops them from
here and then drops their hashes itself (hash-table cleanup and the ``BlockRemoved`` event),
so vLLM's prefix cache stays consistent.

Invariants:
    * Every free block (ref_cnt 0, not the null block) is in exactly one of: the uncached
      list (vLLM's own linked list, no hash) or the policy's candidates
      (``replica/eviction/pool_candidates.py``, which the simulator's pool shares);
      ``num_free_blocks == uncached.num_free_blocks + len(policy)``.
    * Uncached blocks are handed out before any cached one: a cached block is evicted only
      when no never-cached free block is left.
    * The side tables (blocks, release context) are lists indexed by block id: bounded by
      the pool size, O(1) per operation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, get_block_hash

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import SINGLE_TURN, RequestClass
from unicache.replica.eviction.base import EvictionPolicy
from unicache.replica.eviction.pool_candidates import PoolCandidates


@dataclass(slots=True, frozen=True)
class ReleaseContext:
    """What a policy learns when one request frees its blocks (see ``EvictionPolicy``).

    ``positions`` maps block id -> index in that request's block table.
    """

    cls: RequestClass
    positions: dict[int, int]
    num_blocks: int
    num_prompt_blocks: int


_UNKNOWN_RELEASE = ReleaseContext(SINGLE_TURN, {}, 1, 1)


class PolicyFreeQueue:
    """Free blocks of one vLLM ``BlockPool``, ordered for eviction by ``policy``.

    Args:
        free_blocks: the pool's free blocks at install time; all must be uncached (install
            before the first request).
        num_blocks: size of the pool (bounds the side tables).
        policy: an eviction policy from ``unicache.replica.eviction.registry``.
        clock: seconds for the policy's notion of time (default ``time.monotonic``).
    """

    def __init__(
        self,
        free_blocks: list[KVCacheBlock],
        num_blocks: int,
        policy: EvictionPolicy,
        clock: Callable[[], float] = time.monotonic,
    ):
        if any(b.block_hash is not None for b in free_blocks):
            raise ValueError("PolicyFreeQueue must be installed while no block is cached")
        self.policy = policy
        self.clock = clock
        self._uncached = FreeKVCacheBlockQueue(list(free_blocks))
        self._blocks: list[KVCacheBlock | None] = [None] * num_blocks
        for b in free_blocks:
            self._blocks[b.block_id] = b
        self._cands = PoolCandidates(policy, num_blocks)
        self._release: list[ReleaseContext | None] = [None] * num_blocks
        self.access_cls: RequestClass = SINGLE_TURN  # class of the request being allocated

    @property
    def evictions(self) -> int:
        return self._cands.evictions

    # ------------------------------------------------------------ vLLM's interface
    @property
    def num_free_blocks(self) -> int:
        return self._uncached.num_free_blocks + len(self.policy)

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks to reuse: never-cached first, then the policy's victims in order."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} free")
        k = min(n, self._uncached.num_free_blocks)
        out = self._uncached.popleft_n(k) if k else []
        if k < n:
            out.extend(self._blocks[vid] for vid in self._cands.evict(n - k))
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """A free block is taken back by a request (a prefix-cache hit)."""
        if not self._cands.take_back(block.block_id, self.access_cls, self.clock()):
            self._uncached.remove(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks whose last reference went, in vLLM's release order (a request's tail first).

        Cached ones become the policy's candidates, told with the class and positions of
        the request that released them (``note_release``); the others join the uncached list.
        """
        now = self.clock()
        uncached: list[KVCacheBlock] = []
        run: list[int] = []
        run_ctx: ReleaseContext | None = None
        for block in blocks:
            bid = block.block_id
            self._blocks[bid] = block
            h = self._hash_of(block)
            if h is None:
                uncached.append(block)
                continue
            self._cands.tell_cached(bid, h, -1, now)
            ctx = self._release[bid] or _UNKNOWN_RELEASE
            if ctx is not run_ctx and run:
                self._release_run(run, run_ctx, now)
                run = []
            run_ctx = ctx
            run.append(bid)
        if run:
            self._release_run(run, run_ctx, now)
        if uncached:
            self._uncached.append_n(uncached)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """vLLM prepends the blocks it wants reused first: uncached ones only."""
        for b in blocks:
            self._blocks[b.block_id] = b
        if any(self._hash_of(b) is not None for b in blocks):
            self.append_n([b for b in blocks if self._hash_of(b) is not None])
            blocks = [b for b in blocks if self._hash_of(b) is None]
        if blocks:
            self._uncached.prepend_n(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Uncached free blocks in reuse order, then the candidates by id (tests; O(pool))."""
        cands = [b for b in self._blocks if b is not None and self._cands.is_candidate(b.block_id)]
        return self._uncached.get_all_free_blocks() + cands

    # ------------------------------------------------------------ our hooks
    def note_release(self, blocks: Iterable[KVCacheBlock], cls: RequestClass, num_prompt_blocks: int) -> None:
        """Record who is about to free ``blocks`` (one request's table, in table order)."""
        table = [b for b in blocks if not b.is_null]
        ctx = ReleaseContext(cls, {b.block_id: i for i, b in enumerate(table)}, len(table), num_prompt_blocks)
        for b in table:
            self._release[b.block_id] = ctx

    def note_cached(self, blocks: list[KVCacheBlock], start: int, end: int) -> None:
        """vLLM just cached ``blocks[start:end]`` (one request's table): tell the policy,
        with each block's parent in the table."""
        now = self.clock()
        for i in range(start, end):
            block = blocks[i]
            if block.is_null:
                continue
            self._blocks[block.block_id] = block
            h = self._hash_of(block)
            if h is None:
                continue
            parent = blocks[i - 1].block_id if i > 0 and not blocks[i - 1].is_null else -1
            self._cands.tell_cached(block.block_id, h, parent, now)

    def on_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache``): candidates become uncached."""
        moved = [self._blocks[bid] for bid in self._cands.drop_all()]
        if moved:
            self._uncached.append_n(moved)

    def queue_sizes(self) -> dict[str, int]:
        return self.policy.queue_sizes()

    # ------------------------------------------------------------ internals
    @staticmethod
    def _hash_of(block: KVCacheBlock) -> BlockHash | None:
        key = block.block_hash
        return None if key is None else BlockHash(bytes(get_block_hash(key)))

    def _release_run(self, ids: list[int], ctx: ReleaseContext, now: float) -> None:
        positions = [ctx.positions.get(bid, 0) for bid in ids]
        self._cands.release_many(ids, positions, ctx.cls, ctx.num_blocks, ctx.num_prompt_blocks, now)
