"""UniCache eviction: four class-aware queues and a global, adaptively weighted choice.

Queues (by the class of the request that released the block):
    evict_first  decode blocks of single-turn requests, and prompt blocks of single-turn
                 requests outside a template prefix.
    chat         blocks of chat sessions (any multi-turn session not classed agent).
    agent        blocks of agent sessions (short inter-turn gaps).
    structural   the template prefix blocks of single-turn templated requests.
The session queues are split into lanes by turn depth (turn 0, 1, 2, 3-4, 5-8, 9+): a
session that has already run many turns is more likely to continue. The other two are
split by the block's hit count (0, 1, 2-3, 4-7, 8-15, 16+): hot templates apart from cold.
Each queue's seventh lane takes a request's last prompt block, often a partial block the
next turn rewrites.

Each lane is a heap ordered by *last use* (ties: release order, so a request's tail goes
before its head, as in vLLM). ``pop_victim`` scores each lane's head and evicts the
lowest, victim = argmin alpha_lane * s_q, as in the paper, with these measured changes
(each switchable by a constructor flag, for the ablation table in
``bench/unicache_ablation.py``):

    * alpha ("reuse" weighting, default): p = the decayed fraction of the lane's released
      blocks that were reused later, counting reuses of *evicted* blocks through a ghost
      list of their hashes (otherwise eviction would hide reuse and confirm itself). The
      paper's efficiency weights (hits / capacity, normalised, ^(1/T), clipped, EMA) are
      ``weighting="efficiency"``; they lost badly to lru on Mooncake.
    * s_q: S_q = 1 - CDF_q of a log-normal fitted online. Session gaps are fitted from
      the *release* of a session's previous turn to the *arrival* of its next (hit gaps
      are censored by eviction): that is the age a session block has when it is reused,
      the age s_q is evaluated at. Arrival-to-arrival gaps (``gap_from_release=False``)
      also count the previous turn's decode time, which a block's age does not (mix,
      4 replicas x 1%, seeds 0-2, bench/routing_report.py before and after: 49.96 ->
      50.44% token hits; pooled 53.06 -> 53.34); evict-first
      shares the chat fit (its blocks are reused only if the request opens a session);
      the structural queue keeps its prior unless ``structural_fit``.
    * ``horizon_scoring`` (default): the score is the probability of reuse within the
      cache's residence time tau (EMA of victims' ages) given survival so far,
      p (S(a) - S(a + tau)) / (1 - p + p S(a)), instead of p S(a): a block whose reuse is
      likely but far away is worth less than one likely to be reused soon.
    * ``structural_rate_halflife_s`` (default 120 s): a structural block's reuse is a
      Poisson stream whose rate is estimated from its decayed access count
      c = sum_i 2^(-(now - t_i)/h) (LRFU's CRF; a stream of rate r has E[c] = r h / ln 2),
      scored p (1 - exp(-r tau)), P(reuse within the residence time). Its heap key is the
      count as an effective time E (c = 2^((E - now)/h)), which all blocks age alike, so
      heap order is score order; an evicted block's E rides in the ghost list and is
      resumed on re-caching (frequency history across evictions, as in TinyLFU). A hot
      template that paused outlives a cold one used once more recently. Measured (mean of
      mix seeds 0-5, 4 replicas x 1%): pooled 52.3 -> 53.2% token hits, cache_aware 46.3
      -> 47.5; one replica at 2% of the seed-0 mix: +3.6 points. 0: by last use.
    * Otherwise structural blocks go by last use: cold templates before hot ones and deep
      blocks before shallow ones (a parent is used at least as recently as its child);
      ``depth_bonus_s`` adds the paper's 1 - offset/max_offset as seconds of recency (to
      the effective time E in rate mode).
    * ``strict_evict_first`` (off by default) restores the paper's "always emptied
      first"; with *inferred* classes a "single-turn" request may open a session.

Invariants:
    * A block is a candidate iff it is in ``_live``; it then has exactly one live heap
      entry (``_live[id] is entry``) in its lane's heap; other entries are stale and skipped on
      pop (lazy invalidation); a heap is compacted once stale entries outnumber live ones.
    * ``_crf`` holds an effective time only for blocks released into the structural
      queue (or re-cached from a structural ghost) and loses it on eviction/removal.
    * Within a lane, p and S are shared, so with ``horizon_scoring`` off heap order is
      score order exactly; with it on, the head is the lowest-scored block of its lane
      among blocks past the gap distribution's mode (the hazard of a log-normal falls
      after it), which is where victims come from.
    * Every operation is O(log n) amortised; ``pop_victim`` rescores only the lanes that
      changed since the last call (all 28 when the clock, a fit or the weights moved) and
      takes the minimum; ``pop_victims(n)`` is n of them in one loop.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

from unicache.block_hash import BlockHash
from unicache.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.lognormal import _SQRT2, OnlineLogNormal
from unicache.replica.eviction.registry import register_policy

EVICT_FIRST, CHAT, AGENT, STRUCTURAL = 0, 1, 2, 3
QUEUE_NAMES = ("evict_first", "chat", "agent", "structural")
NUM_QUEUES = 4
# Session queues are split into lanes by turn depth: turn 0, 1, 2, 3-4, 5-8, 9+.
# (Mooncake: P(session continues) is 0.25 after turn 0, 0.39 after 1, 0.49 after 2 and
# 0.81 after 8+; one reuse estimate per queue would blur that.)
NUM_LANES = 7
_TURN_LANE = (0, 1, 2, 3, 3, 4, 4, 4, 4)
# The last lane of each queue holds a request's last prompt block (with a trace's
# partial last block, the next turn rewrites it: in Mooncake it is never reused).
TAIL_LANE = NUM_LANES - 1


_ALL_LANES = range(NUM_QUEUES * NUM_LANES)
_LANE_QUEUE = tuple(lane // NUM_LANES for lane in _ALL_LANES)
_LN2 = math.log(2.0)


def turn_lane(turn: int) -> int:
    return _TURN_LANE[turn] if turn < len(_TURN_LANE) else TAIL_LANE - 1

# Priors of log(gap seconds): chat/agent from the paper's code; evict-first and structural
# start like chat (weak priors, replaced by observed gaps).
_PRIORS = {EVICT_FIRST: (4.77, 1.279), CHAT: (4.77, 1.279), AGENT: (1.81, 1.092), STRUCTURAL: (4.77, 1.279)}


# A heap entry: (key = effective last use, token, block id, lane). Tokens are unique, so
# heap comparisons never reach the block id. ``_live[block_id] is entry`` marks it live.
_Entry = tuple[float, int, int, int]


@register_policy("unicache")
class UniCachePolicy(EvictionPolicy):
    """Four-queue UniCache eviction (see module docstring).

    Args:
        strict_evict_first: always evict from evict-first while it holds a candidate
            (the paper's rule). Off: it competes by score like the other queues.
        session_queues: route session blocks to the chat/agent queues (off: evict-first
            or structural only).
        split_agent: separate agent sessions from chat (off: all sessions share chat).
        structural: route template prefix blocks to the structural queue.
        depth_bonus_s: seconds of extra recency for the shallowest template block,
            decreasing linearly to 0 at the template's end (paper's 1 - offset/max_offset).
        online_fit: fit the session queues' gap distributions online from the gaps of
            their sessions (off: the paper's priors only).
        gap_from_release: a session gap runs from the previous turn's release to the
            next turn's arrival (default); off: from arrival to arrival.
        weighting: how alpha_q is set: "reuse" (default: alpha_q = p_q, the decayed
            fraction of the queue's released blocks that were reused, counting reuses of
            evicted blocks through a ghost list, so the score alpha_q * s_q estimates the
            probability that the block is reused), "efficiency" (the paper's
            hits/capacity weights) or "none" (alpha_q = 1).
        ghost_factor: ghost list size, as a multiple of the peak candidate count.
        reuse_decay: per-update decay of the reuse counters of "reuse" weighting.
        fit_prior_weight: observations the gap priors are worth in the online fits.
        max_sessions: sessions whose last release (or arrival) is remembered for gap
            fitting (oldest dropped first).
        horizon_scale: tau = horizon_scale * (EMA of victims' ages).
        turn_lanes: split session queues into lanes by turn depth, each with its own
            reuse estimate (the heap order stays valid: one lane, one p and one S).
        freq_lanes: split the evict-first and structural queues into lanes by the
            block's hits since it was cached (0, 1, 2-3, 4-7, 8-15, 16+): a hot template's
            blocks get their own, higher reuse estimate.
        tail_lane: give each queue's last-prompt blocks a lane (and reuse estimate) of
            their own.
        horizon_scoring: score P(reuse within the cache's residence time | age), i.e.
            p (S(a) - S(a + tau)) / (1 - p + p S(a)), tau = EMA of victims' ages, instead
            of p S(a) (reuse at any later time). Not with "efficiency" weighting.
        structural_fit: fit the structural queue's gaps from its hits (off: keep the
            prior; hit gaps of one hot system-prompt block swamp colder templates). Not
            used while ``structural_rate_halflife_s`` is on.
        structural_rate_halflife_s: half-life h of the decayed access count that scores
            structural blocks as Poisson reuse at rate c ln2 / h (default 120 s; 0: by
            last use with the log-normal prior, as before).
        temperature: T of alpha_q = (E_q / mean E)^(1/T).
        alpha_ema: smoothing of alpha updates.
        alpha_min / alpha_max: clip of alpha_q.
        update_every: requests between alpha updates.
    """

    def __init__(
        self,
        strict_evict_first: bool = False,
        session_queues: bool = True,
        split_agent: bool = True,
        structural: bool = True,
        depth_bonus_s: float = 0.0,
        online_fit: bool = True,
        temperature: float = 0.2,
        alpha_ema: float = 0.1,
        alpha_min: float = 0.05,
        alpha_max: float = 20.0,
        update_every: int = 32,
        weighting: str = "reuse",
        ghost_factor: float = 2.0,
        reuse_decay: float = 0.995,
        fit_prior_weight: float = 20.0,
        max_sessions: int = 100_000,
        structural_fit: bool = False,
        structural_rate_halflife_s: float = 120.0,
        horizon_scale: float = 1.0,
        turn_lanes: bool = True,
        freq_lanes: bool = True,
        tail_lane: bool = True,
        horizon_scoring: bool = True,
        gap_from_release: bool = True,
    ):
        if temperature <= 0 or not 0 < alpha_ema <= 1 or not 0 < alpha_min <= 1 <= alpha_max:
            raise ValueError("need temperature > 0, 0 < alpha_ema <= 1, alpha_min <= 1 <= alpha_max")
        if update_every <= 0 or depth_bonus_s < 0:
            raise ValueError("update_every must be positive and depth_bonus_s >= 0")
        if weighting not in _WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(_WEIGHTINGS)}")
        self.weighting = weighting
        self._ghosting = weighting == "reuse"  # evicted hashes are remembered as ghosts
        self.ghost_factor = ghost_factor
        self.reuse_decay = reuse_decay
        self.strict_evict_first = strict_evict_first
        self.session_queues = session_queues
        self.split_agent = split_agent
        self.structural = structural
        self.depth_bonus_s = depth_bonus_s
        self.inv_temperature = 1.0 / temperature
        self.alpha_ema = alpha_ema
        self.alpha_min, self.alpha_max = alpha_min, alpha_max
        self.update_every = update_every
        self.max_sessions = max_sessions
        self.structural_fit = structural_fit
        if structural_rate_halflife_s < 0:
            raise ValueError("structural_rate_halflife_s must be >= 0")
        self.rate_halflife = structural_rate_halflife_s
        # cached block -> E, its decayed access count as an effective time:
        # sum_i 2^(-(now - t_i)/h) == 2^((E - now)/h) over the block's accesses t_i.
        self._crf: dict[int, float] = {}
        self.horizon_scoring = horizon_scoring
        # NOTE: the horizon score needs p to be a probability; the paper's efficiency
        # weights are not (they range up to alpha_max), so with them it is alpha * S(age).
        self._horizon_on = horizon_scoring and weighting != "efficiency"
        self.horizon_scale = horizon_scale
        self.turn_lanes = turn_lanes
        self.freq_lanes = freq_lanes
        self.tail_lane = tail_lane
        self._last_pos, self._last_decode = -1, False  # previous on_release (burst detection)
        self._horizon = 60.0  # EMA of victims' ages: how long a block stays after last use
        self._victims, self._victim_age_sum = 0, 0.0  # since the last horizon update
        self.gap_from_release = gap_from_release
        # (tenant, session id) -> when its last turn released blocks (or arrived, with
        # gap_from_release off); insertion order is age order for the bound.
        self._session_seen: dict[tuple[str, str], float] = {}
        self.fits = [
            OnlineLogNormal(
                *_PRIORS[q],
                prior_weight=fit_prior_weight,
                max_weight=max(5000.0, fit_prior_weight),
                frozen=not online_fit,
            )
            for q in range(4)
        ]
        # Evict-first blocks are reused only when their request turns out to open a
        # session, so their reuse gap is a chat inter-turn gap: share that fit.
        self.fits[EVICT_FIRST] = self.fits[CHAT]
        n = NUM_QUEUES * NUM_LANES
        self.alpha = [1.0] * n
        self._heaps: list[list[_Entry]] = [[] for _ in range(n)]
        self._live: dict[int, _Entry] = {}
        self._sizes = [0, 0, 0, 0]
        self._lane_sizes = [0] * n
        # Cached score of each lane's head (inf when empty). A lane is rescored when it
        # changed (``_dirty``) or when the clock, fits or weights moved (``_all_dirty``).
        self._scores = [math.inf] * n
        self._dirty: set[int] = set()
        self._all_dirty = True
        self._hits = [0, 0, 0, 0]
        self._size_sum = [0, 0, 0, 0]
        self._requests = 0
        self._tokens = itertools.count()
        self._now = 0.0
        self._hash: dict[int, BlockHash] = {}
        self._uses: dict[int, int] = {}  # cached block -> hits since it was cached
        # Evicted hashes -> (lane, key): a later re-cache is a reuse the eviction missed.
        self._ghosts: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self._peak = 0
        self._released = [1.0] * n
        self._reused = [0.5] * n

    # ------------------------------------------------------------ placement
    def queue_of(self, info: ReleaseInfo) -> int:
        """The queue a released block joins (public for tests and the ablation)."""
        q, template_blocks = self._placement(info.cls)
        if q >= 0:
            return q
        return STRUCTURAL if not info.is_decode and info.position < template_blocks else EVICT_FIRST

    def _placement(self, cls: RequestClass) -> tuple[int, int]:
        """Where a ``cls`` request's blocks go: (the queue of all of them, or -1 when it
        depends on the block; how many leading prompt blocks join the structural queue,
        the others joining evict-first)."""
        if cls.session_id is not None and self.session_queues:
            return (AGENT if (self.split_agent and cls.agentic) else CHAT), 0
        return -1, (cls.template_blocks if self.structural and cls.template else 0)

    # ---------------------------------------------------------------- hooks
    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        if now > self._now:
            self._now = now
            self._all_dirty = True
        self._hash[block_id] = block_hash
        self._uses[block_id] = 0
        ghost = self._ghosts.pop(block_hash, None)
        if self.rate_halflife and ghost is not None and ghost[0] // NUM_LANES == STRUCTURAL:
            # NOTE: a re-cached template block keeps its access history (its ghost key is
            # its effective time), as TinyLFU keeps counts of evicted keys.
            self._crf[block_id] = self._combine(ghost[1], now)
        if ghost is not None:
            lane, key = ghost
            self._reused[lane] += 1.0
            if lane // NUM_LANES == STRUCTURAL and self.structural_fit:
                self.fits[STRUCTURAL].observe(now - key)

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
        """Make one request's released blocks candidates, in release order.

        The same outcome as one release per block; what does not depend on the block
        (the clock, the session's release time, its queue and turn lane) is done once.
        """
        if not block_ids:
            return
        if now > self._now:
            self._now = now
            self._all_dirty = True
        if cls.session_id is not None and self.gap_from_release:
            # Once: noting the same session at the same time again changes nothing.
            self._note_session(cls, now)
        fixed_q, template_blocks = self._placement(cls)
        structural_below = min(template_blocks, num_prompt_blocks)  # prompt blocks only
        turn_offset = turn_lane(cls.turn) if self.turn_lanes else 0
        h, depth_bonus = self.rate_halflife, self.depth_bonus_s
        tail_lane, freq_lanes = self.tail_lane, self.freq_lanes
        crf, uses, tokens, heaps = self._crf, self._uses, self._tokens, self._heaps
        live, released, sizes, lane_sizes = self._live, self._released, self._sizes, self._lane_sizes
        mark_dirty, heappush = self._dirty.add, heapq.heappush
        # NOTE: the store releases a request's blocks tail first (positions falling), so
        # the first prompt block of a release burst is the request's last cached prompt
        # block. A heuristic: a burst that starts below the previous burst's last position
        # is missed, and a tail still shared by another request marks its predecessor.
        last_pos, last_decode = self._last_pos, self._last_decode
        for block_id, pos in zip(block_ids, positions):
            key = now
            if fixed_q >= 0:
                q = fixed_q
            elif pos < structural_below:
                q = STRUCTURAL
                if h:
                    # Only structural blocks carry a decayed count (from their first
                    # release, which follows their caching within one request).
                    key = crf.setdefault(block_id, now)
                if depth_bonus:
                    key += depth_bonus * (1.0 - pos / template_blocks)
            else:
                q = EVICT_FIRST
            is_decode = pos >= num_prompt_blocks
            is_tail = not is_decode and (pos >= last_pos or last_decode)
            last_pos, last_decode = pos, is_decode
            lane = q * NUM_LANES
            if is_tail and tail_lane:
                lane += TAIL_LANE
            elif q == CHAT or q == AGENT:
                lane += turn_offset
            elif freq_lanes:
                hot = uses.get(block_id, 0).bit_length()
                lane += hot if hot < TAIL_LANE - 1 else TAIL_LANE - 1
            entry = (key, next(tokens), block_id, lane)
            released[lane] += 1.0
            live[block_id] = entry
            sizes[q] += 1
            lane_sizes[lane] += 1
            mark_dirty(lane)
            heap = heaps[lane]
            heappush(heap, entry)
            if len(heap) > 2 * lane_sizes[lane] + 64:
                self._compact(lane)  # replaces heaps[lane]
        self._last_pos, self._last_decode = last_pos, last_decode
        # Keys were only added to _live above, so its peak is its size now.
        if len(live) > self._peak:
            self._peak = len(live)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        if now > self._now:
            self._now = now
            self._all_dirty = True
        uses = self._uses
        if block_id in uses:
            uses[block_id] += 1
        if self.rate_halflife:
            crf = self._crf
            if block_id in crf:
                crf[block_id] = self._combine(crf[block_id], now)
        entry = self._live.pop(block_id, None)
        if entry is None:
            return
        lane = entry[3]
        q = lane // NUM_LANES
        self._sizes[q] -= 1
        self._lane_sizes[lane] -= 1
        self._dirty.add(lane)
        self._hits[q] += 1
        self._reused[lane] += 1.0
        if q == STRUCTURAL and self.structural_fit:
            self.fits[q].observe(now - entry[0])

    def on_request(self, cls: RequestClass, now: float) -> None:
        if now > self._now:
            self._now = now
        self._all_dirty = True  # fits, alpha and the horizon may change below
        if self._victims:
            decay = 0.99**self._victims
            self._horizon = decay * self._horizon + (1.0 - decay) * self._victim_age_sum / self._victims
            self._victims, self._victim_age_sum = 0, 0.0
        sid = cls.session_id
        if sid is not None:
            # NOTE: session gaps are measured here, at arrivals, not from cache hits: hits
            # only show the gaps of blocks that survived eviction (a censored sample that
            # understates long gaps and makes the policy drop sessions too early). A turn
            # that arrives before its predecessor released anything observes nothing.
            last = self._session_seen.pop((cls.tenant, sid), None)
            if last is not None and now > last:
                self.fits[AGENT if (self.split_agent and cls.agentic) else CHAT].observe(now - last)
            if not self.gap_from_release:
                self._note_session(cls, now)
        sizes, sums = self._sizes, self._size_sum
        for q in range(4):
            sums[q] += sizes[q]
        self._requests += 1
        if self._requests % self.update_every == 0:
            self._update_alpha()

    def _note_session(self, cls: RequestClass, now: float) -> None:
        """Remember ``now`` as the session's last release (or arrival), bounded."""
        seen = self._session_seen
        seen[(cls.tenant, cls.session_id)] = now
        if len(seen) > self.max_sessions:
            del seen[next(iter(seen))]

    def pop_victim(self) -> int | None:
        victims = self.pop_victims(1)
        return victims[0] if victims else None

    def pop_victims(self, n: int) -> list[int]:
        """Up to ``n`` victims, as ``n`` calls of ``pop_victim`` would pick them.

        Scores the dirty lanes (all of them after the clock, a fit or the weights moved)
        and evicts the head of the lowest. One allocation's victims come in one loop
        with the policy's state bound to locals: the clock does not move between them,
        so after the first pop only the popped lane is rescored. A lane's score is
        alpha_lane * s_q of its head (inf when empty); the survival arithmetic is
        ``OnlineLogNormal.survival``'s, written out, so scores are the same floats.
        """
        live, dirty, scores, heaps = self._live, self._dirty, self._scores, self._heaps
        sizes, lane_sizes, alpha, fits = self._sizes, self._lane_sizes, self.alpha, self.fits
        uses, crf, hashes, ghosts = self._uses, self._crf, self._hash, self._ghosts
        ghosting, ghost_limit = self._ghosting, self.ghost_factor * self._peak
        strict = self.strict_evict_first
        now, age_sum = self._now, self._victim_age_sum
        tau = self.horizon_scale * self._horizon
        horizon_on, h = self._horizon_on, self.rate_halflife
        heappop, log, erfc, inf = heapq.heappop, math.log, math.erfc, math.inf
        victims: list[int] = []
        for _ in range(n):
            if not live:
                break
            if strict and self._head(EVICT_FIRST * NUM_LANES) is not None:
                best = EVICT_FIRST * NUM_LANES
            else:
                if self._all_dirty:
                    self._all_dirty = False
                    lanes = _ALL_LANES
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
                    age = now - entry[0]
                    q = _LANE_QUEUE[lane]
                    p = alpha[lane]
                    if h and q == STRUCTURAL:
                        # Poisson reuse at the decayed-count rate estimate r = crf ln2 / h
                        # (a stream of rate r has E[crf] = r h / ln 2): P(reuse within tau).
                        rate = math.exp(-age * _LN2 / h) * _LN2 / h
                        scores[lane] = p * -math.expm1(-rate * tau)
                        continue
                    fit = fits[q]
                    mu, sd = fit.mu, fit.sigma * _SQRT2
                    s_now = 0.5 * erfc((log(age) - mu) / sd) if age > 0 else 1.0
                    if horizon_on:
                        later = age + tau
                        s_later = 0.5 * erfc((log(later) - mu) / sd) if later > 0 else 1.0
                        scores[lane] = p * (s_now - s_later) / (1.0 - p + p * s_now + 1e-12)
                    else:
                        scores[lane] = p * s_now
                dirty.clear()
                # NOTE: list.index(min(...)) is the first lowest lane, as min(key=...)
                # was, with the comparisons done in C.
                best = scores.index(min(scores))
            key, _, block_id, _ = heappop(heaps[best])
            age = now - key
            if age > 0.0:
                age_sum += age
            del live[block_id]
            sizes[_LANE_QUEUE[best]] -= 1
            lane_sizes[best] -= 1
            dirty.add(best)
            uses.pop(block_id, None)
            crf.pop(block_id, None)
            hash_ = hashes.pop(block_id, None)
            if hash_ is not None and ghosting:
                ghosts[hash_] = (best, key)
                if len(ghosts) > ghost_limit:
                    ghosts.popitem(last=False)
            victims.append(block_id)
        self._victims += len(victims)
        self._victim_age_sum = age_sum
        return victims

    def on_removed(self, block_id: int) -> None:
        self._hash.pop(block_id, None)
        self._uses.pop(block_id, None)
        self._crf.pop(block_id, None)
        entry = self._live.pop(block_id, None)
        if entry is not None:
            lane = entry[3]
            self._sizes[lane // NUM_LANES] -= 1
            self._lane_sizes[lane] -= 1
            self._dirty.add(lane)

    def __len__(self) -> int:
        return len(self._live)

    def queue_sizes(self) -> dict[str, int]:
        return dict(zip(QUEUE_NAMES, self._sizes))

    def weight(self, queue: int, turn: int = 0, uses: int = 0) -> float:
        """alpha of the lane a block of ``queue`` (session ``turn``, ``uses`` hits) joins."""
        lane = queue * NUM_LANES
        if queue == CHAT or queue == AGENT:
            lane += turn_lane(turn) if self.turn_lanes else 0
        elif self.freq_lanes:
            lane += min(TAIL_LANE - 1, uses.bit_length())
        return self.alpha[lane]

    # ------------------------------------------------------------ internals
    def _combine(self, e: float, t: float) -> float:
        """Effective time after one more access at ``t``: h log2(2^(e/h) + 2^(t/h))."""
        h = self.rate_halflife
        hi, lo = (e, t) if e >= t else (t, e)
        return hi + h * math.log1p(math.exp((lo - hi) * _LN2 / h)) / _LN2

    def _head(self, lane: int) -> _Entry | None:
        """The lane's live minimum, dropping stale entries above it."""
        heap, live = self._heaps[lane], self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                return entry
            heapq.heappop(heap)
        return None

    def _compact(self, lane: int) -> None:
        """Drop stale entries of a lane (amortised O(1): runs after >= n stale pushes)."""
        live = self._live
        heap = [e for e in self._heaps[lane] if live.get(e[2]) is e]
        heapq.heapify(heap)
        self._heaps[lane] = heap

    def _update_alpha(self) -> None:
        _WEIGHTINGS[self.weighting](self)
        self._hits = [0, 0, 0, 0]
        self._size_sum = [0, 0, 0, 0]

    def _alpha_reuse(self) -> None:
        """alpha_q <- p_q, the fraction of the queue's releases reused later (hits, plus
        re-caches of evicted blocks remembered as ghosts, so eviction does not hide reuse)."""
        d = self.reuse_decay
        for lane in range(NUM_QUEUES * NUM_LANES):
            # NOTE: capped at 1: a ghost can be re-cached by several requests in a row.
            self.alpha[lane] = min(1.0, self._reused[lane] / self._released[lane])
            self._reused[lane] *= d
            self._released[lane] *= d

    def _alpha_efficiency(self) -> None:
        """alpha_q <- EMA of clip((E_q / mean E)^(1/T)) with E_q = hits_q / mean size_q."""
        n = self.update_every
        eff: dict[int, float] = {}
        for q in range(4):
            mean_size = self._size_sum[q] / n
            if mean_size >= 1.0:
                eff[q] = self._hits[q] / mean_size
        if not eff:
            return
        mean_e = sum(eff.values()) / len(eff)
        if mean_e <= 0:
            return
        for q, e in eff.items():
            raw = (e / mean_e) ** self.inv_temperature if e > 0 else self.alpha_min
            raw = min(self.alpha_max, max(self.alpha_min, raw))
            for lane in range(q * NUM_LANES, (q + 1) * NUM_LANES):
                self.alpha[lane] += self.alpha_ema * (raw - self.alpha[lane])

    def _alpha_fixed(self) -> None:
        """alpha_q = 1 (ablation: no global weights)."""


# How alpha_q is set: name -> method (registry, so a new scheme is one entry).
_WEIGHTINGS = {
    "reuse": UniCachePolicy._alpha_reuse,
    "efficiency": UniCachePolicy._alpha_efficiency,
    "none": UniCachePolicy._alpha_fixed,
}
