"""UniCache on the host tier: the GPU UniCache's eviction order, kept per class.

A host tier holds what the GPU tier evicted (``unicache.replica.kv.host_tier``); a block
reaches it only after the GPU's UniCache ranked it lowest, with what the GPU knows of it
and the host does not (its hits, its structural access history, whether its prefix is
novel, the lane weights measured where the reuse happens). The host tier keeps that
ranking: its victim is the block the GPU's UniCache demoted earliest. The blocks wait in
UniCache's four queues (``lanes.LanePlacement.queue_of``, by the class and position of
their last GPU release), which the cache-state APIs and metrics show per queue; the
class does not reorder them.

    victim = the earliest-demoted block of the evict-first, chat, agent and structural
             queues.

Why no class weighting on the host (the host_tier_drops study, docs/studies.md; tuning traces:
mix seeds 100-104 labelled and with labels hidden, 1200 s and seed 100 hidden at
3600 s, and Mooncake slice 0 of 4; GPU unicache at 5% / 10%, host 4x / 10x):
    * the GPU's lane scores on the host (``UniCachePolicy``, the rule before) evicted
      young blocks of the lanes whose drops were reused most (Mooncake slice 0, GPU 5%,
      host 4x: the chat turn-2 lane at a mean age of 114 s, 38% of its drops requested
      again, against 12% of lru's drops) and lost to lru on both tiers (21.82% against
      22.53% block hits; hidden-label mix 101: 70.12 against 70.83);
    * alpha / age, with ages from the last release or the demotion, and the lane of the
      lowest alpha first, lost as well (figures in the study);
    * the evict-first queue first, then demotion order (the paper's evict-first rule),
      won most on the mixes (mix 100: 70.58 against lru-both 68.12) but lost 0.07 / 0.06
      points to lru-both on Mooncake slice 0 (GPU 5% / host 10x, 10% / 4x); it was this
      module's rule for one report run, which put it 3.34 points below lru-both on the
      reported Mooncake slices 1-3 (GPU 5%, host 4x: 29.93% against 33.27%): with labels
      inferred, the evict-first queue holds the first turns of sessions the classifier
      has not seen yet, which a strict priority drops first;
    * the demotion order is the one rule that beat lru-both on every tuning row (e.g.
      Mooncake slice 0, GPU 5%, host 4x: 22.84 against 22.53; mix 101 hidden: 71.23
      against 70.83; mix 100 hidden at 3600 s: 73.51 against 73.22).

Invariants:
    * Every candidate is in ``_queue_of`` (demotion order, oldest first) with the queue it
      is filed in, and ``_sizes[q]`` counts the candidates filed in queue ``q``; as the
      class does not reorder, the four queues are one demotion order and every operation
      is O(1).
"""

from __future__ import annotations

from collections import OrderedDict

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, QueueCounters, ReleaseInfo
from unicache.replica.eviction.unicache.lanes import NUM_QUEUES, QUEUE_NAMES, LanePlacement


class HostUniCachePolicy(EvictionPolicy):
    """The host tier's UniCache (module docstring): what ``--host-eviction-policy
    unicache`` builds (``registry.make_host_policy``)."""

    name = "unicache"

    def __init__(self) -> None:
        self.placement = LanePlacement()
        self._queue_of: OrderedDict[int, int] = OrderedDict()
        self._sizes = [0] * NUM_QUEUES
        self._evictions = [0] * NUM_QUEUES
        self._hits = [0] * NUM_QUEUES

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        pass

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        q = self.placement.queue_of(info)
        self._queue_of[block_id] = q
        self._sizes[q] += 1

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        q = self._queue_of.pop(block_id, None)
        if q is not None:
            self._sizes[q] -= 1
            self._hits[q] += 1

    def pop_victim(self) -> int | None:
        if not self._queue_of:
            return None
        block_id, q = self._queue_of.popitem(last=False)
        self._sizes[q] -= 1
        self._evictions[q] += 1
        return block_id

    def on_removed(self, block_id: int) -> None:
        q = self._queue_of.pop(block_id, None)
        if q is not None:
            self._sizes[q] -= 1

    def __len__(self) -> int:
        return len(self._queue_of)

    def queue_sizes(self) -> dict[str, int]:
        return dict(zip(QUEUE_NAMES, self._sizes))

    def queue_counters(self) -> QueueCounters:
        return QueueCounters(dict(zip(QUEUE_NAMES, self._evictions)), dict(zip(QUEUE_NAMES, self._hits)))

    def order(self) -> list[int]:
        """Candidates in eviction order (tests)."""
        return list(self._queue_of)
