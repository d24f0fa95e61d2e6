"""The host-memory tier's bookkeeping: slots, the hash map and the tier's own eviction policy.

The KV store (``unicache.replica.kv.store``) drives it: a GPU victim with a hash is
*demoted* here (``put``) instead of dropped, and a prefix match that runs on past the GPU
cache into this tier *promotes* those blocks (``take``) into fresh GPU blocks. The tier is
exclusive: a hash is in the GPU cache or here, never both (the store keeps that).

Host blocks are never referenced by a request (the forward pass reads only the GPU pool),
so every cached slot is an eviction candidate of ``policy``; the policy sees a demoted
block as ``on_cached`` then ``on_release`` with the ``ReleaseInfo`` of its last GPU
release (class, position, release time), so a class-aware policy orders the host tier by
the same classes as the GPU tier. Its ``parent_id`` is the parent's slot when the parent
is in this tier, ``-1`` when the block has no cached parent anywhere (as the GPU tier
passes it), and ``outside_parent`` (``num_blocks``, an id no slot has) when the parent is
cached on the GPU: a parent the policy never holds, not the root. (With -1 there, every
demoted tail looked like the start of a prefix nothing shares, which ``unicache``'s
novel lane evicts first.)

Invariants (``check_invariants``):
    * every slot is exactly one of: free (in ``_free``), cached (``_cached[h].slot``, a
      policy candidate), pinned (taken for a promotion whose copy is not yet recorded as
      done; ``release`` returns it to free);
    * ``len(policy) == len(_cached)``;
    * ``_by_slot[s].block_hash == h`` iff ``_cached[h] is _by_slot[s]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo


@dataclass(slots=True, eq=False)
class HostBlock:
    """One host slot's identity while it holds a block (the KV bytes live in the engine's
    host buffer at index ``slot``)."""

    slot: int
    block_hash: BlockHash
    parent_hash: BlockHash | None


@dataclass(slots=True)
class HostStats:
    hit_blocks: int = 0  # blocks promoted because a prefix match ran into this tier
    demotions: int = 0  # GPU victims stored here
    dropped_demotions: int = 0  # GPU victims that found no slot (every slot pinned)
    evictions: int = 0  # blocks this tier dropped to make room


class HostTier:
    """``num_blocks`` host slots evicted by ``policy`` (a registry policy over slot ids)."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy):
        if num_blocks <= 0:
            raise ValueError("host tier needs at least one block")
        self.num_blocks = num_blocks
        self.policy = policy
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._cached: dict[BlockHash, HostBlock] = {}
        self._by_slot: dict[int, HostBlock] = {}
        self._pinned: set[int] = set()
        self.stats = HostStats()
        self.outside_parent = num_blocks

    # ---------------------------------------------------------------- queries
    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def __len__(self) -> int:
        """Blocks held (cached, not pinned)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def slot_of(self, block_hash: BlockHash) -> int:
        return self._cached[block_hash].slot

    # ---------------------------------------------------------------- changes
    def put(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, info: ReleaseInfo, now: float,
        parent_on_gpu: bool = False,
    ) -> tuple[int | None, BlockHash | None]:
        """Store a demoted block. Returns ``(slot, evicted_hash)``: the slot it now holds
        (None: every slot pinned, the block is dropped) and the hash this tier evicted to
        make room (None if a slot was free). ``parent_on_gpu``: the parent is cached in the
        GPU tier (see the module docstring)."""
        assert block_hash not in self._cached, "a hash is in one tier at most"
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.policy.pop_victim()
            if victim is None:
                self.stats.dropped_demotions += 1
                return None, None
            old = self._by_slot.pop(victim)
            del self._cached[old.block_hash]
            evicted = old.block_hash
            self.stats.evictions += 1
            slot = victim
        block = HostBlock(slot, block_hash, parent_hash)
        self._cached[block_hash] = block
        self._by_slot[slot] = block
        parent = self._cached.get(parent_hash) if parent_hash is not None else None
        if parent is not None:
            parent_id = parent.slot
        else:
            parent_id = self.outside_parent if parent_on_gpu else -1
        self.policy.on_cached(slot, block_hash, parent_id, now)
        self.policy.on_release(slot, info)
        self.stats.demotions += 1
        return slot, evicted

    def take(self, block_hash: BlockHash, cls: RequestClass, now: float) -> int:
        """Promote: the block leaves this tier (a hit) and its slot stays pinned until
        ``release``, so no demotion overwrites it before its copy to the GPU is recorded."""
        block = self._cached.pop(block_hash)
        del self._by_slot[block.slot]
        self.policy.on_access(block.slot, cls, now)
        self.policy.on_removed(block.slot)
        self._pinned.add(block.slot)
        self.stats.hit_blocks += 1
        return block.slot

    def release(self, slots: list[int]) -> None:
        """Pinned slots become free (their promotions' copies are recorded)."""
        for slot in slots:
            self._pinned.remove(slot)
            self._free.append(slot)

    def discard(self, block_hash: BlockHash) -> None:
        """Drop a block whose hash the GPU cache now holds (it was recomputed there)."""
        block = self._cached.pop(block_hash)
        del self._by_slot[block.slot]
        self.policy.on_removed(block.slot)
        self._free.append(block.slot)

    def clear(self) -> list[BlockHash]:
        """Drop every held block (reset); returns their hashes."""
        dropped = list(self._cached)
        for block in self._by_slot.values():
            self.policy.on_removed(block.slot)
            self._free.append(block.slot)
        self._cached.clear()
        self._by_slot.clear()
        return dropped

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host slot is free twice"
        held = set(self._by_slot)
        assert not (free & held) and not (free & self._pinned) and not (held & self._pinned)
        assert len(free) + len(held) + len(self._pinned) == self.num_blocks, "a host slot is lost"
        assert len(self._cached) == len(self._by_slot)
        for h, block in self._cached.items():
            assert block.block_hash == h and self._by_slot[block.slot] is block
        assert len(self.policy) == len(self._cached), (
            f"host policy holds {len(self.policy)} candidates, tier {len(self._cached)}"
        )
