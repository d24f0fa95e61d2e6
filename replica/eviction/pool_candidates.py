"""The cached free blocks of a paged KV pool, handed to an eviction policy as its candidates.

One definition of what vLLM's free queue does with its cached blocks once a policy of our
registry orders them. The ``--scheduler-cls`` plug-in (``replica/engines/vllm/free_queue.py``)
and the simulator's model of vLLM's pool (``unicache/sim/vllm_pool.py``) both keep their
cached free blocks here, so the simulator makes the plug-in's policy calls by construction,
in the same order with the same arguments. Nothing here imports vLLM.

Invariants:
    * ``is_candidate(b)`` iff ``b`` was released to the policy (``release_many``) and was
      neither taken back by a hit (``take_back``) nor evicted (``evict``) since;
      ``len(self) == len(policy)``.
    * ``told(b)`` is the hash the policy was last told for ``b`` (``tell_cached``), ``None``
      once ``b`` is evicted: the policy hears ``on_cached`` once per (block, hash), and
      ``on_removed`` before a block is told a different hash.
    * The side tables are indexed by block id, bounded by the pool size: O(1) per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy


class PoolCandidates:
    """The policy's view of one pool's cached free blocks.

    Args:
        policy: an eviction policy from ``unicache.replica.eviction.registry``.
        num_blocks: size of the pool (bounds the side tables).
    """

    __slots__ = ("policy", "_candidate", "_told", "evictions")

    def __init__(self, policy: EvictionPolicy, num_blocks: int):
        self.policy = policy
        self._candidate = bytearray(num_blocks)
        self._told: list[BlockHash | None] = [None] * num_blocks
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.policy)

    def is_candidate(self, block_id: int) -> bool:
        return bool(self._candidate[block_id])

    def told(self, block_id: int) -> BlockHash | None:
        return self._told[block_id]

    def tell_cached(self, block_id: int, h: BlockHash, parent: int, now: float) -> None:
        """The pool cached ``block_id`` under ``h`` (``parent``: the block before it in its
        request's table, -1 at the head); a no-op when the policy already knows it."""
        told = self._told[block_id]
        if told == h:
            return
        if told is not None:
            self.policy.on_removed(block_id)  # the block's content changed under another hash
        self._told[block_id] = h
        self.policy.on_cached(block_id, h, parent, now)

    def release_many(self, block_ids: list[int], positions: Sequence[int], cls: RequestClass,
                     num_blocks: int, num_prompt_blocks: int, now: float) -> None:
        """Cached blocks whose last reference went, in release order (a request's tail
        first), ``positions`` their indices in the releasing request's table."""
        for b in block_ids:
            self._candidate[b] = 1
        self.policy.on_release_many(block_ids, positions, cls, num_blocks, num_prompt_blocks, now)

    def take_back(self, block_id: int, cls: RequestClass, now: float) -> bool:
        """A request hit ``block_id``: it leaves the candidates (``on_access``). False when
        it was not a candidate (an uncached free block, the caller's own list)."""
        if not self._candidate[block_id]:
            return False
        self._candidate[block_id] = 0
        self.policy.on_access(block_id, cls, now)
        return True

    def evict(self, n: int) -> list[int]:
        """The policy's next ``n`` victims, in order; each stops being a candidate and its
        told hash is forgotten (the caller drops the block's hash from its cache)."""
        victims = self.policy.pop_victims(n)
        if len(victims) != n:
            raise RuntimeError(f"policy {self.policy.name} gave {len(victims)} victims, {n} needed")
        for vid in victims:
            if not self._candidate[vid]:
                raise RuntimeError(f"policy {self.policy.name} returned block {vid}, which is not free")
            self._candidate[vid] = 0
            self._told[vid] = None
        self.evictions += n
        return victims

    def drop_all(self) -> list[int]:
        """Every candidate leaves (the pool dropped every hash): the ids, by id; the policy
        hears ``on_removed`` for each and nothing is told any more."""
        moved = [b for b, flag in enumerate(self._candidate) if flag]
        for b in moved:
            self.policy.on_removed(b)
            self._candidate[b] = 0
        self._told = [None] * len(self._told)
        return moved
