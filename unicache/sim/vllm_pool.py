"""A metadata model of vLLM 0.32's prefix-cache block pool, evicted by a policy of our registry.

It reproduces what decides vLLM's prefix-cache hits (``vllm/v1/core/block_pool.py``,
``kv_cache_utils.FreeKVCacheBlockQueue``, ``single_type_kv_cache_manager.py``) and the
calls the ``--scheduler-cls`` plug-in (``replica/engines/vllm/free_queue.py``) makes to its
policy, in the same order with the same arguments:

    * block 0 is the null block: a pool of N blocks has N - 1 usable;
    * free blocks without a hash are reused first (vLLM prepends them, LIFO); cached free
      blocks are the policy's candidates. vLLM's own queue keeps every uncached free block
      ahead of every cached one, so ``lru`` here is vLLM's own order exactly;
    * a request frees its block table in reverse (tail first); cached blocks reach the
      policy in that order (``on_release_many``, positions in the table): the cached free
      blocks are the plug-in's own ``PoolCandidates`` (``replica/eviction/pool_candidates.py``),
      so the policy hears the same calls by construction;
    * full blocks are cached as soon as their tokens are scheduled, decode blocks too;
      partial blocks never are;
    * no de-duplication: a block computed again (a fully cached prompt recomputes its last
      block) is cached under the same hash beside the first copy, and a lookup takes the
      copy cached first (``BlockHashToBlockMap``).

Invariants:
    * every usable block is in exactly one of: some request's table (ref > 0), the
      uncached free list (ref 0, no hash), the policy's candidates (ref 0, hash);
    * ``num_free_blocks == len(uncached) + len(policy)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy
from unicache.replica.eviction.pool_candidates import PoolCandidates


class VllmBlockPool:
    """vLLM's ``BlockPool`` with the plug-in's free queue (``PolicyFreeQueue``), no tensors.

    Args:
        num_gpu_blocks: blocks in the pool, the null block included.
        policy: orders the cached free blocks (``lru`` is vLLM's own order).
        clock: the policy's notion of time (seconds).
    """

    def __init__(self, num_gpu_blocks: int, policy: EvictionPolicy, clock: Callable[[], float]):
        if num_gpu_blocks < 2:
            raise ValueError("a vLLM pool needs at least 2 blocks (one is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.policy = policy
        self.clock = clock
        self._uncached: deque[int] = deque(range(1, num_gpu_blocks))
        self.ref = [0] * num_gpu_blocks
        self.hash: list[BlockHash | None] = [None] * num_gpu_blocks
        self._cands = PoolCandidates(policy, num_gpu_blocks)
        # hash -> the blocks cached under it, first cached first (dict as an ordered set)
        self._map: dict[BlockHash, dict[int, None]] = {}

    @property
    def evictions(self) -> int:
        return self._cands.evictions

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached) + len(self.policy)

    @property
    def capacity_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    def lookup(self, block_hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``block_hashes`` (no side effects)."""
        out = []
        for h in block_hashes:
            blocks = self._map.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def num_evictable(self, block_ids: list[int]) -> int:
        """Of ``block_ids`` (a lookup's hit), those waiting in the free queue."""
        return sum(1 for b in block_ids if self.ref[b] == 0)

    def touch(self, block_ids: list[int], cls: RequestClass) -> None:
        """A request takes hit blocks: free ones leave the queue (the policy's ``on_access``)."""
        now = self.clock()
        for b in block_ids:
            if self.ref[b] == 0 and not self._cands.take_back(b, cls, now):
                self._uncached.remove(b)  # a hit block always has a hash: never here
            self.ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """``n`` blocks: uncached ones first, then the policy's victims (their hashes dropped)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, {self.num_free_blocks} free")
        k = min(n, len(self._uncached))
        out = [self._uncached.popleft() for _ in range(k)]
        if k < n:
            for v in self._cands.evict(n - k):
                h = self.hash[v]
                blocks = self._map[h]
                del blocks[v]
                if not blocks:
                    del self._map[h]
                self.hash[v] = None
                out.append(v)
        for b in out:
            self.ref[b] = 1
        return out

    def cache_full_blocks(self, table: list[int], hashes: list[BlockHash], start: int, end: int) -> None:
        """vLLM caches ``table[start:end]`` under ``hashes[start:end]``; the plug-in then
        tells the policy each newly hashed block, with its parent in the table."""
        now = self.clock()
        for i in range(start, end):
            b, h = table[i], hashes[i]
            if self.hash[b] != h:
                assert self.hash[b] is None, "a cached block's hash never changes"
                self.hash[b] = h
                self._map.setdefault(h, {})[b] = None
            self._cands.tell_cached(b, h, table[i - 1] if i > 0 else -1, now)

    def free(self, table: list[int], cls: RequestClass, num_prompt_blocks: int) -> None:
        """A request's blocks released tail first: uncached ones to the front of the free
        list, cached ones to the policy (``on_release_many`` in release order)."""
        now = self.clock()
        first: list[int] = []
        released: list[int] = []
        positions: list[int] = []
        for pos in range(len(table) - 1, -1, -1):
            b = table[pos]
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b]:
                continue
            if self.hash[b] is None:
                first.append(b)
            else:
                released.append(b)
                positions.append(pos)
        if first:
            self._uncached.extendleft(reversed(first))  # prepend_n: first[0] at the front
        if released:
            self._cands.release_many(released, positions, cls, len(table), num_prompt_blocks, now)
