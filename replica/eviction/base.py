"""The eviction policy plug-in interface.

The KV store owns blocks; a policy only orders the *evictable* ones (cached, ref_cnt 0)
and answers ``pop_victim``. The store calls, in order of a block's life:

    on_cached(id, hash, parent_id, now)  -- the block's hash entered the cache (ref_cnt > 0)
    on_release(id, info)                 -- ref_cnt dropped to 0: now a victim candidate
    on_release_many(ids, positions, cls, num_blocks, num_prompt_blocks, now)
                                         -- the same for all of one request's blocks that
                                            reached ref_cnt 0 when it was freed, in release
                                            order (tail first); the store's only release
                                            call. The default is on_release per block, with
                                            the same ReleaseInfo in the same order; a policy
                                            may override it to do per-request work once,
                                            but its outcome must equal that loop's
    on_access(id, cls, now)              -- a new request hit the cached block (ref_cnt
                                            goes up); if it was a candidate it stops being one
    pop_victim() -> id                   -- remove and return the best candidate
    pop_victims(n) -> [id, ...]          -- the same, n times over (one allocation's
                                            victims); a policy may override it to
                                            keep its state in locals across pops
    on_removed(id)                       -- the block left the cache by any route other
                                            than pop_victim (e.g. reset)

Every operation must be O(1) or O(log n) in the number of cached blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass


@dataclass(slots=True)
class ReleaseInfo:
    """What the store knows about a block when its last reference goes.

    Attributes:
        cls: class of the request that released it.
        position: index of the block in that request's block table (0 = first block).
        num_blocks: length of that request's block table.
        is_decode: the block was filled during decode (not part of the prompt).
        now: release time in seconds (wall clock or simulated).
    """

    cls: RequestClass
    position: int
    num_blocks: int
    is_decode: bool
    now: float


@dataclass(slots=True)
class QueueCounters:
    """Cumulative counts per eviction queue, since the policy was built.

    ``evictions[q]``: victims taken from queue ``q``. ``hits[q]``: prefix-cache hits on a
    block while it waited in queue ``q`` (a hit on a block another request holds is in no
    queue, so it is not counted here). Both keyed by the names of ``queue_sizes``.
    """

    evictions: dict[str, int]
    hits: dict[str, int]


class EvictionPolicy(ABC):
    """Orders evictable blocks. Subclasses register themselves in ``unicache.replica.eviction.registry``."""

    name: str = "base"
    # The class a host tier builds under this policy's name (None: this class); see
    # ``registry.make_host_policy``.
    host_tier_policy: "type[EvictionPolicy] | None" = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # NOTE: a subclass that redefines on_release but inherits a batched
        # on_release_many gets the per-block loop back, so its on_release sees every
        # block (the batched overrides bypass on_release).
        if "on_release" in cls.__dict__ and "on_release_many" not in cls.__dict__:
            cls.on_release_many = EvictionPolicy.on_release_many

    @abstractmethod
    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None: ...

    @abstractmethod
    def on_release(self, block_id: int, info: ReleaseInfo) -> None: ...

    def on_release_many(
        self,
        block_ids: list[int],
        positions: list[int],
        cls: RequestClass,
        num_blocks: int,
        num_prompt_blocks: int,
        now: float,
    ) -> None:
        """Release one request's blocks at once: ``on_release`` for each, in order.

        Args:
            block_ids: the released blocks, in release order (tail first).
            positions: ``positions[i]`` is ``block_ids[i]``'s index in the request's
                block table.
            cls: class of the request that released them.
            num_blocks: length of that request's block table.
            num_prompt_blocks: blocks holding the prompt; a block at a position at or
                past it was filled during decode.
            now: release time in seconds.
        """
        on_release = self.on_release
        for block_id, pos in zip(block_ids, positions):
            on_release(block_id, ReleaseInfo(cls, pos, num_blocks, pos >= num_prompt_blocks, now))

    @abstractmethod
    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None: ...

    @abstractmethod
    def pop_victim(self) -> int | None:
        """Remove and return the id of the block to evict, or None if none is evictable."""

    def pop_victims(self, n: int) -> list[int]:
        """Up to ``n`` victims, exactly as ``n`` calls of ``pop_victim`` would return them
        (fewer only when candidates run out)."""
        victims = []
        for _ in range(n):
            victim = self.pop_victim()
            if victim is None:
                break
            victims.append(victim)
        return victims

    @abstractmethod
    def on_removed(self, block_id: int) -> None: ...

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable candidates."""

    def queue_sizes(self) -> dict[str, int]:
        """Candidates per internal queue (shown in cache-state APIs)."""
        return {self.name: len(self)}

    def queue_counters(self) -> "QueueCounters | None":
        """Cumulative evictions and hits per internal queue (replica metrics), or None for
        a policy that keeps no per-queue counts (the engine then reports its total
        evictions under the policy's name, exact for a one-queue policy)."""
        return None

    def on_request(self, cls: RequestClass, now: float) -> None:
        """Hook called once per admitted request (policies that adapt use it)."""
