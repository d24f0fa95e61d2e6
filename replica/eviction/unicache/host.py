"""UniCache on the host tier: the evict-first queue first, then the GPU's demotion order.

A host tier holds what the GPU tier evicted (``unicache.replica.kv.host_tier``); a block
reaches it only after the GPU's UniCache ranked it lowest, with what the GPU knows of it
and the host does not (its hits, its structural access history, whether its prefix is
novel). The host policy keeps UniCache's queues (``lanes.LanePlacement.queue_of``, by the
class and position of the block's last GPU release) and the paper's evict-first rule, and
orders by demotion otherwise:

    victim = the earliest-demoted block of the evict-first queue while it has one, else
             the earliest-demoted block of the chat, agent and structural queues.

Why not the GPU's lane scores (bench/studies/host_tier_drops.py, tuning traces only: mix
seeds 100-104 labelled and with labels hidden, and the first quarter of the Mooncake
trace, GPU 5% / 10% with a host tier of 4x / 10x): on the host, lane weights and
session-gap survivals evicted young blocks of lanes whose drops were reused most (Mooncake
slice 0, GPU 5%, host 4x: chat lanes of turn 2 at a mean age of 114 s with 38% of the
drops requested again, against 12% for lru's drops) and lost to lru on both tiers there
(21.82% against 22.53% block hits) and on the hidden-label mixes (seed 101, GPU 5%, host
4x: 70.12 against 70.83). The demotion order alone (lru on the host) won every one of
those rows but gave up the class: on the labelled mix the evict-first queue is dead
weight the host kept (seed 100: 68.56 against 70.58 with this rule). This rule beat lru on
both tiers on every mix row and on Mooncake slice 0 at GPU 5% / host 4x (22.75 against
22.53), and lost 0.07 / 0.06 points there at 5% / 10x and 10% / 4x.

Invariants:
    * A candidate is in exactly one of the four queues (``_queues[q]``, demotion order,
      oldest first) and in ``_queue_of``; every operation is O(1).
"""

from __future__ import annotations

from collections import OrderedDict

from unicache.block_hash import BlockHash
from unicache.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, QueueCounters, ReleaseInfo
from unicache.replica.eviction.unicache.lanes import EVICT_FIRST, NUM_QUEUES, QUEUE_NAMES, LanePlacement


class HostUniCachePolicy(EvictionPolicy):
    """The host tier's UniCache (module docstring): what ``--host-eviction-policy
    unicache`` builds (``registry.make_host_policy``)."""

    name = "unicache"

    def __init__(self) -> None:
        self.placement = LanePlacement()
        self._queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(NUM_QUEUES)]
        self._queue_of: dict[int, int] = {}
        self._seq = 0
        self._evictions = [0] * NUM_QUEUES
        self._hits = [0] * NUM_QUEUES

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        pass

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        q = self.placement.queue_of(info)
        self._queue_of[block_id] = q
        self._queues[q][block_id] = self._seq
        self._seq += 1

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        q = self._queue_of.pop(block_id, None)
        if q is not None:
            del self._queues[q][block_id]
            self._hits[q] += 1

    def pop_victim(self) -> int | None:
        queues = self._queues
        best = EVICT_FIRST
        if not queues[EVICT_FIRST]:
            best, oldest = -1, -1
            for q in range(NUM_QUEUES):
                if q != EVICT_FIRST and queues[q]:
                    seq = next(iter(queues[q].values()))
                    if best < 0 or seq < oldest:
                        best, oldest = q, seq
            if best < 0:
                return None
        block_id, _ = queues[best].popitem(last=False)
        del self._queue_of[block_id]
        self._evictions[best] += 1
        return block_id

    def on_removed(self, block_id: int) -> None:
        q = self._queue_of.pop(block_id, None)
        if q is not None:
            del self._queues[q][block_id]

    def __len__(self) -> int:
        return len(self._queue_of)

    def queue_sizes(self) -> dict[str, int]:
        return {name: len(queue) for name, queue in zip(QUEUE_NAMES, self._queues)}

    def queue_counters(self) -> QueueCounters:
        return QueueCounters(dict(zip(QUEUE_NAMES, self._evictions)), dict(zip(QUEUE_NAMES, self._hits)))

    def order(self) -> list[int]:
        """Candidates in eviction order (tests)."""
        rest = sorted((seq, b) for q in range(NUM_QUEUES) if q != EVICT_FIRST for b, seq in self._queues[q].items())
        return list(self._queues[EVICT_FIRST]) + [b for _, b in rest]
