"""The UniCache eviction policy: class-aware lanes and a global choice by reuse probability.

A released block joins a lane (``lanes.LanePlacement``), by its request's class, its
hits and whether it belongs to a novel prefix (``_novel``); each lane is a heap ordered by
its key: the block's last use, or for structural lanes its effective time
(``scoring.StructuralRate``); ties go by release order, so a request's tail leaves before
its head, as in vLLM. ``pop_victim`` scores each lane's head and evicts the lowest,
victim = argmin alpha_lane * s: alpha from ``weights.ReuseWeights``, s from
``scoring`` with the session-gap fits of ``gaps.SessionGaps``. The one exception is the
novel lane, emptied first (the paper's evict-first rule, for the blocks that share
nothing with the cache's contents or its ghosts): as in S3-FIFO and ARC, a block must
be seen twice, the second time through the ghost list, to compete on its reuse estimate.

Invariants:
    * A block is a candidate iff it is in ``_live``; it then has exactly one live heap
      entry (``_live[id] is entry``), in its lane's heap; other entries are stale and
      skipped on pop (lazy invalidation); a heap is compacted once its stale entries
      exceed its live ones (plus a slack of 64).
    * Within a lane, alpha and the fit are shared and scores fall with the key past the
      gap distribution's mode (the hazard of a log-normal falls after it), so the head
      is the lane's lowest-scored block among those, which is where victims come from.
    * ``_novel`` holds exactly the cached blocks of novel prefixes: a block joins it when
      cached if it was no ghost and its parent is the root or in ``_novel``, and leaves
      it when hit or evicted (so a subset of the cached blocks, O(1) per operation).
    * Every operation is O(log n) amortised; ``pop_victim`` rescores only the lanes that
      changed since the last call (all of them when the clock, a fit or the weights
      moved) and takes the minimum; ``pop_victims(n)`` is n of them in one loop.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, QueueCounters, ReleaseInfo
from unicache.replica.eviction.registry import register_policy
from unicache.replica.eviction.unicache.gaps import SessionGaps
from unicache.replica.eviction.unicache.guard import RecencyGuard
from unicache.replica.eviction.unicache.host import HostUniCachePolicy
from unicache.replica.eviction.unicache.lanes import (
    ALL_LANES,
    EVICT_FIRST,
    LANE_QUEUE,
    NOVEL_LANE,
    NUM_LANES,
    NUM_QUEUES,
    QUEUE_NAMES,
    STRUCTURAL,
    LanePlacement,
)
from unicache.replica.eviction.unicache.scoring import ResidenceTime, StructuralRate, horizon_score
from unicache.replica.eviction.unicache.weights import ReuseWeights

# A heap entry: (key, token, block id, lane, release time). Tokens are unique, so heap
# comparisons never reach the block id. ``_live[block_id] is entry`` marks it live. The
# key is the release time except in structural lanes (an effective time, scoring.py), so
# a victim's residence is measured from the release time, never from the key.
_Entry = tuple[float, int, int, int, float]
_NOVEL = EVICT_FIRST * NUM_LANES + NOVEL_LANE


@register_policy("unicache")
class UniCachePolicy(EvictionPolicy):
    """Four-queue UniCache eviction (see the module docstring and docs/eviction.md). A host tier
    under ``unicache`` runs ``HostUniCachePolicy`` instead (``host.py``: this policy's
    demotion order, kept per queue).

    Args:
        update_every: requests between recomputations of the lane weights.
        reuse_decay: per-update decay of the weights' reuse counts (their memory).
        ghost_factor: evicted hashes remembered to count missed reuse, as a multiple
            of the peak candidate count.
        fit_prior_weight: observations the session-gap priors are worth.
        max_sessions: sessions whose last release is remembered for gap fitting.
        horizon_scale: tau = horizon_scale * (EMA of victims' ages).
        structural_rate_halflife_s: half-life of the decayed access count that scores
            structural blocks.
        evict_first_prior: reuse probability of an evict-first block before any is
            measured (every other lane: 0.5). Below the sessions' prior, so from a cold
            start one-off requests leave before a live session of the same age (a labelled
            session survived six one-off prompts only with it: tests/replica/test_engine_live_session.py).
        recency_guard: run the recency guard (``guard.py``): where a shadow LRU hits more
            than UniCache on the traffic at hand, take a growing share of victims in LRU
            order (False: UniCache's own order always).
        guard_margin: the hit-ratio difference (share of lookups) the guard acts on.
        guard_window: requests per guard window.
        guard_decay: per-window decay of the guard's counts (their memory, in windows).
    """

    host_tier_policy = HostUniCachePolicy

    def __init__(
        self,
        update_every: int = 32,
        reuse_decay: float = 0.995,
        ghost_factor: float = 2.0,
        fit_prior_weight: float = 20.0,
        max_sessions: int = 100_000,
        horizon_scale: float = 1.0,
        structural_rate_halflife_s: float = 120.0,
        evict_first_prior: float = 0.1,
        recency_guard: bool = True,
        guard_margin: float = 0.003,
        guard_window: int = 8,
        guard_decay: float = 0.98,
    ):
        n = NUM_QUEUES * NUM_LANES
        priors = [evict_first_prior if LANE_QUEUE[lane] == EVICT_FIRST else 0.5 for lane in ALL_LANES]
        self.placement = LanePlacement()
        self.weights = ReuseWeights(priors, reuse_decay, ghost_factor, update_every)
        self.gaps = SessionGaps(fit_prior_weight, max_sessions)
        self.rate = StructuralRate(structural_rate_halflife_s)
        self.residence = ResidenceTime(horizon_scale)
        self._heaps: list[list[_Entry]] = [[] for _ in range(n)]
        self._live: dict[int, _Entry] = {}
        self._sizes = [0] * NUM_QUEUES
        self._lane_sizes = [0] * n
        # Cached score of each lane's head (inf when empty). A lane is rescored when it
        # changed (``_dirty``) or when the clock, fits or weights moved (``_all_dirty``).
        self._scores = [math.inf] * n
        self._dirty: set[int] = set()
        self._all_dirty = True
        self._tokens = itertools.count()
        self._now = 0.0
        self._hash: dict[int, BlockHash] = {}
        self._uses: dict[int, int] = {}  # cached block -> hits since it was cached
        self._novel: set[int] = set()  # cached blocks of novel prefixes (lanes.py)
        # Cumulative per queue (QueueCounters): victims taken, hits while waiting.
        self._queue_evictions = [0] * NUM_QUEUES
        self._queue_hits = [0] * NUM_QUEUES
        # The recency guard: candidates in release order (vLLM's LRU order) and each
        # cached block's parent, for the shadow LRU's prefix rule.
        self.guard = RecencyGuard(margin=guard_margin, window=guard_window, decay=guard_decay) if recency_guard else None
        self._order: OrderedDict[int, None] = OrderedDict()
        self._parent: dict[int, int] = {}

    @property
    def alpha(self) -> list[float]:
        return self.weights.alpha

    def queue_of(self, info: ReleaseInfo) -> int:
        """The queue a released block joins (tests)."""
        return self.placement.queue_of(info)

    def weight(self, queue: int, turn: int = 0, uses: int = 0) -> float:
        """alpha of the (non-tail) lane a block of ``queue`` (session ``turn``, ``uses``
        hits) joins."""
        return self.weights.alpha[self.placement.lane(queue, False, turn, uses)]

    # ---------------------------------------------------------------- hooks
    def _advance(self, now: float) -> None:
        if now > self._now:
            self._now = now
            self._all_dirty = True

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._advance(now)
        self._hash[block_id] = block_hash
        self._uses[block_id] = 0
        guard = self.guard
        if guard is not None:
            self._parent[block_id] = parent_id
            guard.on_cached(block_hash, self._hash.get(parent_id) if parent_id >= 0 else None, len(self._hash))
        ghost = self.weights.recall(block_hash)
        if ghost is None:
            if parent_id < 0 or parent_id in self._novel:
                self._novel.add(block_id)
        elif LANE_QUEUE[ghost[0]] == STRUCTURAL:
            self.rate.resume(block_id, ghost[1], now)

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        # A batch of one (a block at or past num_prompt_blocks is a decode block).
        pos = info.position
        self._release((block_id,), (pos,), info.cls, pos if info.is_decode else pos + 1, info.now)

    def on_release_many(
        self,
        block_ids: list[int],
        positions: list[int],
        cls: RequestClass,
        num_blocks: int,
        num_prompt_blocks: int,
        now: float,
    ) -> None:
        self._release(block_ids, positions, cls, num_prompt_blocks, now)

    def _release(
        self,
        block_ids: Sequence[int],
        positions: Sequence[int],
        cls: RequestClass,
        num_prompt_blocks: int,
        now: float,
    ) -> None:
        """Make one request's released blocks candidates, in release order (the same
        outcome as one release per block)."""
        if not block_ids:
            return
        self._advance(now)
        self.gaps.on_release(cls, now)
        lanes = self.placement.place(block_ids, positions, cls, num_prompt_blocks, self._uses, self._novel)
        self.weights.on_released(lanes)
        structural_key = self.rate.key
        tokens, heaps, live = self._tokens, self._heaps, self._live
        sizes, lane_sizes, mark_dirty, heappush = self._sizes, self._lane_sizes, self._dirty.add, heapq.heappush
        if self.guard is not None:
            order, hashes = self._order, self._hash
            for block_id in block_ids:
                order.pop(block_id, None)
                order[block_id] = None
            self.guard.on_released(hashes[b] for b in block_ids if b in hashes)
        for block_id, lane in zip(block_ids, lanes):
            q = LANE_QUEUE[lane]
            key = structural_key(block_id, now) if q == STRUCTURAL else now
            entry = (key, next(tokens), block_id, lane, now)
            live[block_id] = entry
            sizes[q] += 1
            lane_sizes[lane] += 1
            mark_dirty(lane)
            heap = heaps[lane]
            heappush(heap, entry)
            if len(heap) > 2 * lane_sizes[lane] + 64:
                self._compact(lane)  # replaces heaps[lane]
        # Keys were only added to _live above, so its peak is its size now.
        if len(live) > self.weights.peak:
            self.weights.peak = len(live)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._advance(now)
        uses = self._uses
        if block_id in uses:
            uses[block_id] += 1
        self._novel.discard(block_id)
        self.rate.on_access(block_id, now)
        guard = self.guard
        if guard is not None:
            h = self._hash.get(block_id)
            if h is not None:
                parent = self._parent.get(block_id, -1)
                guard.on_hit(h, self._hash.get(parent) if parent >= 0 else None)
            self._order.pop(block_id, None)
        entry = self._live.pop(block_id, None)
        if entry is None:
            return
        lane = entry[3]
        queue = LANE_QUEUE[lane]
        self._sizes[queue] -= 1
        self._queue_hits[queue] += 1
        self._lane_sizes[lane] -= 1
        self._dirty.add(lane)
        self.weights.on_hit(lane)

    def on_request(self, cls: RequestClass, now: float) -> None:
        if now > self._now:
            self._now = now
        self._all_dirty = True  # fits, weights and the residence time may change below
        self.residence.fold()
        if cls.session_id is not None:
            self.gaps.on_arrival(cls, self.placement.session_queue(cls), now)
        self.weights.on_request()
        if self.guard is not None:
            self.guard.on_request()

    def pop_victim(self) -> int | None:
        victims = self.pop_victims(1)
        return victims[0] if victims else None

    def pop_victims(self, n: int) -> list[int]:
        """Up to ``n`` victims, as ``n`` calls of ``pop_victim`` would pick them.

        The clock does not move between one allocation's victims, so after the first
        pop only the popped lane is rescored.
        """
        live, dirty, scores, heaps = self._live, self._dirty, self._scores, self._heaps
        sizes, lane_sizes, evicted = self._sizes, self._lane_sizes, self._queue_evictions
        uses, hashes, forget, remember = self._uses, self._hash, self.rate.forget, self.weights.remember
        not_novel = self._novel.discard
        score, choose = self._score, self._choose
        guard, order = self.guard, self._order
        take_lru = guard.take_lru if guard is not None else None
        now, age_sum = self._now, 0.0
        heappop, inf = heapq.heappop, math.inf
        victims: list[int] = []
        for _ in range(n):
            if not live:
                break
            if self._all_dirty:
                self._all_dirty = False
                lanes = ALL_LANES
            else:
                lanes = dirty
            for lane in lanes:
                if not lane_sizes[lane]:
                    scores[lane] = inf
                    continue
                # The live head: a non-empty lane has one, so the heap cannot run dry.
                heap = heaps[lane]
                entry = heap[0]
                while live.get(entry[2]) is not entry:
                    heappop(heap)
                    entry = heap[0]
                scores[lane] = score(lane, now - entry[0])
            dirty.clear()
            best = choose(scores)
            if guard is not None and take_lru():
                # The recency guard's share: the oldest release instead (its lane's heap
                # keeps a stale entry, skipped on pop).
                block_id = next(iter(order))
                key, _, _, best, released = live[block_id]
            else:
                key, _, block_id, _, released = heappop(heaps[best])
            if guard is not None:
                order.pop(block_id, None)
                self._parent.pop(block_id, None)
            if now > released:
                age_sum += now - released
            del live[block_id]
            queue = LANE_QUEUE[best]
            sizes[queue] -= 1
            evicted[queue] += 1
            lane_sizes[best] -= 1
            dirty.add(best)
            uses.pop(block_id, None)
            not_novel(block_id)
            forget(block_id)
            hash_ = hashes.pop(block_id, None)
            if hash_ is not None:
                remember(hash_, best, key)
                if guard is not None:
                    guard.on_uncached(hash_)
            victims.append(block_id)
        self.residence.note(len(victims), age_sum)
        return victims

    def _score(self, lane: int, age: float) -> float:
        """The score of a lane's head of age ``age`` (now - its key)."""
        q = LANE_QUEUE[lane]
        p = self.weights.alpha[lane]
        if q == STRUCTURAL:
            return self.rate.score(p, age, self.residence.tau)
        return horizon_score(p, self.gaps.fit(q), age, self.residence.tau)

    def _choose(self, scores: list[float]) -> int:
        """The lane to evict from: the novel lane while it holds a candidate, else the
        first lowest score."""
        if self._lane_sizes[_NOVEL]:
            return _NOVEL
        # NOTE: list.index(min(...)) does the comparisons in C.
        return scores.index(min(scores))

    def on_removed(self, block_id: int) -> None:
        h = self._hash.pop(block_id, None)
        if self.guard is not None:
            if h is not None:
                self.guard.on_uncached(h)
            self._order.pop(block_id, None)
            self._parent.pop(block_id, None)
        self._uses.pop(block_id, None)
        self._novel.discard(block_id)
        self.rate.forget(block_id)
        entry = self._live.pop(block_id, None)
        if entry is not None:
            lane = entry[3]
            self._sizes[LANE_QUEUE[lane]] -= 1
            self._lane_sizes[lane] -= 1
            self._dirty.add(lane)

    def __len__(self) -> int:
        return len(self._live)

    def queue_sizes(self) -> dict[str, int]:
        return dict(zip(QUEUE_NAMES, self._sizes))

    def queue_counters(self) -> QueueCounters:
        return QueueCounters(dict(zip(QUEUE_NAMES, self._queue_evictions)), dict(zip(QUEUE_NAMES, self._queue_hits)))

    def _compact(self, lane: int) -> None:
        """Drop a lane's stale entries (amortised O(1): runs after >= n stale pushes)."""
        live = self._live
        heap = [e for e in self._heaps[lane] if live.get(e[2]) is e]
        heapq.heapify(heap)
        self._heaps[lane] = heap
