"""Folding cache events into one ``KVEventBatch`` (pure; the publisher does the I/O).

A batch carries sets, not an ordered log: a reader applies ``cleared`` first, then
``removed``, then ``stored`` (router/cluster/index.py ``apply_events``). So the batch keeps each
hash's *net* effect: a hash stored then removed inside one batch appears only in
``removed``; removed then stored, only in ``stored``. With that rule, applying a batch on
top of any state that already reflects a prefix of its events gives the same result as
applying the events one by one -- which is what lets a summary snapshot be taken while
the engine keeps storing blocks (events after the snapshot are replayed harmlessly).

Each stored hash keeps its parent's hash (``BlockStored.parent_hash``), published as
``stored_parents`` so the router's index knows the chains and trims them from the tail.

The host tier's events (``tier`` HOST) fold the same way into ``host_stored`` /
``host_removed``, apart from the GPU's: a demotion is a GPU remove plus a host store.

Invariant: a hash is never in both ``stored`` and ``removed``, nor in both ``host_stored``
and ``host_removed``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.contract.kv_tier import Tier
from unicache.v1 import cache_pb2


@dataclass(slots=True)
class PendingBatch:
    """Events taken from the engine and not yet published."""

    stored: dict[BlockHash, BlockHash | None] = field(default_factory=dict)  # hash -> parent
    removed: dict[BlockHash, None] = field(default_factory=dict)
    host_stored: dict[BlockHash, None] = field(default_factory=dict)
    host_removed: dict[BlockHash, None] = field(default_factory=dict)
    cleared: bool = False
    num_events: int = 0

    def add(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            self.num_events += 1
            if isinstance(ev, BlockStored):
                if ev.tier is Tier.GPU:
                    self.removed.pop(ev.block_hash, None)
                    self.stored[ev.block_hash] = ev.parent_hash
                else:
                    self.host_removed.pop(ev.block_hash, None)
                    self.host_stored[ev.block_hash] = None
            elif isinstance(ev, BlockRemoved):
                if ev.tier is Tier.GPU:
                    self.stored.pop(ev.block_hash, None)
                    self.removed[ev.block_hash] = None
                else:
                    self.host_stored.pop(ev.block_hash, None)
                    self.host_removed[ev.block_hash] = None
            elif isinstance(ev, AllBlocksCleared):
                # Everything before the clear is superseded by it.
                for d in (self.stored, self.removed, self.host_stored, self.host_removed):
                    d.clear()
                self.cleared = True
            else:
                raise TypeError(f"unknown cache event {type(ev).__name__}")

    def empty(self) -> bool:
        return not (self.stored or self.removed or self.host_stored or self.host_removed or self.cleared)

    def to_proto(self, replica_id: str, epoch: int, seq: int, timestamp: float) -> cache_pb2.KVEventBatch:
        return cache_pb2.KVEventBatch(
            replica_id=replica_id,
            epoch=epoch,
            seq=seq,
            stored=list(self.stored),
            stored_parents=[p or b"" for p in self.stored.values()],
            removed=list(self.removed),
            host_stored=list(self.host_stored),
            host_removed=list(self.host_removed),
            cleared=self.cleared,
            timestamp=timestamp,
        )
