"""The locality index: per replica, the set of block hashes it is believed to hold.

Pure in-memory state fed by whoever reads the replicas' events (the Redis subscriber in
the live router, the simulator's event pump). No I/O here.

Invariants:
    * ``applied_seq[r]`` is the seq of the last event batch applied for replica r in its
      current epoch; a batch with another epoch or a seq gap marks r as needing resync.
    * A replica's set never exceeds ``max_blocks_per_replica``, so memory is bounded even
      if a remove event is lost. Each set is kept in least-recently-used order: a stored
      block is the most recent, and ``match`` refreshes the prefix it found deepest
      first, so within a used chain a block is always less recent than its ancestors.
      Trimming drops the least recent block, hence a leaf of a used prefix before its
      parent (dropping a root would zero every descendant's match).
    * Nor its ``capacity`` (the KV blocks its signed heartbeat announces, 0 = unknown): a
      summary or batch that would leave more is an impossible claim; the index trims it,
      marks the replica for resync and records ``fault = "over_capacity"``.
    * ``fault`` says why the last failed apply marked a resync: "gap", "epoch" or
      "over_capacity" (the subscriber counts it; a gap or impossible claim is resynced
      from the replica itself).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from unicache.block_hash import BlockHash
from unicache.router.routing.base import LocalityView


@dataclass(slots=True)
class ReplicaHoldings:
    blocks: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    epoch: int = -1
    applied_seq: int = -1
    needs_resync: bool = True
    capacity: int = 0
    fault: str = ""


class LocalityIndex(LocalityView):
    """Block hashes per replica with gap detection.

    Args:
        max_blocks_per_replica: bound on each replica's set (default 2,000,000 hashes,
            about 200 MB of Python objects in the worst case).
    """

    def __init__(self, max_blocks_per_replica: int = 2_000_000):
        self.max_blocks = max_blocks_per_replica
        self._replicas: dict[str, ReplicaHoldings] = {}

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def holdings(self, replica_id: str) -> ReplicaHoldings:
        return self._replicas.setdefault(replica_id, ReplicaHoldings())

    def num_blocks(self, replica_id: str) -> int:
        h = self._replicas.get(replica_id)
        return len(h.blocks) if h else 0

    def needs_resync(self, replica_id: str) -> bool:
        h = self._replicas.get(replica_id)
        return h is None or h.needs_resync

    def is_stale(self, replica_id: str) -> bool:
        return self.needs_resync(replica_id)

    def match(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        h = self._replicas.get(replica_id)
        if h is None:
            return 0
        blocks = h.blocks
        n = 0
        for bh in block_hashes:
            if bh not in blocks:
                break
            n += 1
        if n:
            touch = blocks.move_to_end
            for i in range(n - 1, -1, -1):  # NOTE: deepest first: the root ends most recent
                touch(block_hashes[i])
        return n

    def set_capacity(self, replica_id: str, capacity_blocks: int) -> None:
        """The replica's KV capacity in blocks (from its heartbeat); 0 leaves it unknown."""
        self.holdings(replica_id).capacity = capacity_blocks

    def apply_summary(self, replica_id: str, epoch: int, seq: int, block_hashes: Iterable[BlockHash]) -> bool:
        """Replace a replica's holdings by a full summary taken at (epoch, seq).

        Returns False (trimmed to capacity, resync marked) when it claims more blocks than
        the replica's capacity."""
        h = self.holdings(replica_id)
        h.blocks = OrderedDict.fromkeys(block_hashes)
        h.epoch, h.applied_seq, h.needs_resync = epoch, seq, False
        return self._trim(h)

    def apply_events(
        self,
        replica_id: str,
        epoch: int,
        seq: int,
        stored: Iterable[BlockHash],
        removed: Iterable[BlockHash],
        cleared: bool = False,
    ) -> bool:
        """Apply one event batch. Returns False (and marks resync) on a gap or epoch change.

        Batches at or below the applied seq are duplicates and ignored (returns True).
        """
        h = self.holdings(replica_id)
        if epoch != h.epoch or h.needs_resync:
            h.needs_resync, h.fault = True, "epoch"
            return False
        if seq <= h.applied_seq:
            return True
        if seq != h.applied_seq + 1:
            h.needs_resync, h.fault = True, "gap"
            return False
        if cleared:
            h.blocks.clear()
        blocks = h.blocks
        for bh in removed:
            blocks.pop(bh, None)
        for bh in stored:
            blocks[bh] = None
        h.applied_seq = seq
        return self._trim(h)

    def apply_events_unchecked(self, replica_id: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """Apply events from a lossless in-process source (the simulator)."""
        h = self.holdings(replica_id)
        h.needs_resync = False
        for bh in removed:
            h.blocks.pop(bh, None)
        for bh in stored:
            h.blocks[bh] = None
        self._trim(h)

    def mark_resync(self, replica_id: str) -> None:
        self.holdings(replica_id).needs_resync = True

    def drop_replica(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def _trim(self, h: ReplicaHoldings) -> bool:
        """Drop the least recently used blocks (leaves of used prefixes first) down to both
        bounds. Returns False when the capacity bound had to cut (an impossible claim)."""
        while len(h.blocks) > self.max_blocks:
            h.blocks.popitem(last=False)
        if h.capacity and len(h.blocks) > h.capacity:
            while len(h.blocks) > h.capacity:
                h.blocks.popitem(last=False)
            h.needs_resync, h.fault = True, "over_capacity"
            return False
        return True
