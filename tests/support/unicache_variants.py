"""UniCache with one switch per ingredient: a test double for the queue-rule tests.

``AblationUniCache`` is ``UniCachePolicy`` with each part (``unicache.replica.eviction
.unicache``) swappable for a variant defined here, so a test can switch the adaptive parts
off and check the queue rules alone. The production policy has none of these switches:
every variant was measured as losing or neutral by the ablation study (docs/studies.md),
whose code left the repository; the double builds the production policy and then swaps
its parts, so the policy carries no hook for it.
"""

from __future__ import annotations

import inspect

from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.lognormal import OnlineLogNormal
from unicache.replica.eviction.unicache.gaps import CHAT_PRIOR, SessionGaps
from unicache.replica.eviction.unicache.lanes import (
    AGENT,
    CHAT,
    EVICT_FIRST,
    LANE_QUEUE,
    NUM_LANES,
    NUM_QUEUES,
    STRUCTURAL,
    LanePlacement,
)
from unicache.replica.eviction.unicache.policy import _NOVEL, UniCachePolicy
from unicache.replica.eviction.unicache.scoring import StructuralRate, horizon_score
from unicache.replica.eviction.unicache.weights import ReuseWeights

WEIGHTINGS = ("reuse", "efficiency", "none")


class AblationPlacement(LanePlacement):
    """Lane placement with queues or lane splits switched off."""

    def __init__(self, session_queues: bool, split_agent: bool, structural: bool, turn_lanes: bool,
                 freq_lanes: bool, tail_lane: bool, novel_lane: bool = True):
        super().__init__()
        self.session_queues, self.split_agent, self.structural = session_queues, split_agent, structural
        self.turn_lanes, self.freq_lanes, self.tail_lane = turn_lanes, freq_lanes, tail_lane
        self.novel_lane = novel_lane

    def session_queue(self, cls: RequestClass) -> int:
        return super().session_queue(cls) if self.split_agent else CHAT

    def request_queue(self, cls: RequestClass) -> tuple[int, int]:
        if cls.session_id is not None and self.session_queues:
            return self.session_queue(cls), 0
        return -1, (cls.template_blocks if self.structural and cls.template else 0)

    def lane(self, queue: int, is_tail: bool, turn: int, uses: int, novel: bool = False) -> int:
        if is_tail and not self.tail_lane:
            is_tail = False
        novel = novel and self.novel_lane
        lane = super().lane(queue, is_tail, turn, uses, novel)
        session = queue == CHAT or queue == AGENT
        if not is_tail and not novel and ((session and not self.turn_lanes) or (not session and not self.freq_lanes)):
            return queue * NUM_LANES
        return lane


class ArrivalGaps(SessionGaps):
    """Session gaps from arrival to arrival (the previous turn's decode time included)."""

    def on_release(self, cls: RequestClass, now: float) -> None:
        pass

    def on_arrival(self, cls: RequestClass, queue: int, now: float) -> None:
        super().on_arrival(cls, queue, now)
        self._note(cls, now)


class FixedWeights(ReuseWeights):
    """alpha = 1 for every lane (no global weights), no ghost list."""

    def remember(self, block_hash, lane: int, key: float) -> None:
        pass

    def update(self) -> None:
        pass


class EfficiencyWeights(FixedWeights):
    """The paper's weights: alpha_q <- EMA of clip((E_q / mean E)^(1/T)), E_q = hits_q /
    mean size_q over the last ``update_every`` requests (one alpha per queue)."""

    def __init__(self, priors, decay: float, ghost_factor: float, update_every: int,
                 temperature: float = 0.2, alpha_ema: float = 0.1, alpha_min: float = 0.05, alpha_max: float = 20.0):
        super().__init__([1.0] * len(priors), decay, ghost_factor, update_every)
        if temperature <= 0 or not 0 < alpha_ema <= 1 or not 0 < alpha_min <= 1 <= alpha_max:
            raise ValueError("need temperature > 0, 0 < alpha_ema <= 1, alpha_min <= 1 <= alpha_max")
        self.inv_temperature, self.alpha_ema = 1.0 / temperature, alpha_ema
        self.alpha_min, self.alpha_max = alpha_min, alpha_max
        self.hits = [0] * NUM_QUEUES
        self.size_sum = [0] * NUM_QUEUES

    def on_hit(self, lane: int) -> None:
        self.hits[LANE_QUEUE[lane]] += 1

    def add_sizes(self, sizes: list[int]) -> None:
        for q in range(NUM_QUEUES):
            self.size_sum[q] += sizes[q]

    def update(self) -> None:
        n = self.update_every
        eff = {q: self.hits[q] / (self.size_sum[q] / n) for q in range(NUM_QUEUES) if self.size_sum[q] / n >= 1.0}
        self.hits = [0] * NUM_QUEUES
        self.size_sum = [0] * NUM_QUEUES
        mean_e = sum(eff.values()) / len(eff) if eff else 0.0
        if mean_e <= 0:
            return
        for q, e in eff.items():
            raw = (e / mean_e) ** self.inv_temperature if e > 0 else self.alpha_min
            raw = min(self.alpha_max, max(self.alpha_min, raw))
            for lane in range(q * NUM_LANES, (q + 1) * NUM_LANES):
                self.alpha[lane] += self.alpha_ema * (raw - self.alpha[lane])


class LastUseStructural(StructuralRate):
    """Structural blocks keyed by last use (no decayed count), scored by a log-normal prior."""

    def __init__(self) -> None:
        self.halflife = 0.0
        self.effective = {}
        self.prior = OnlineLogNormal(*CHAT_PRIOR)

    def key(self, block_id: int, now: float) -> float:
        return now

    def on_access(self, block_id: int, now: float) -> None:
        pass

    def resume(self, block_id: int, ghost_key: float, now: float) -> None:
        pass

    def forget(self, block_id: int) -> None:
        pass


class AblationUniCache(UniCachePolicy):
    """UniCache with each ingredient switchable (defaults: the production policy).

    Args:
        session_queues / split_agent / structural: route session blocks to the session
            queues / agent sessions apart from chat / template prefixes to structural.
        turn_lanes / freq_lanes / tail_lane / novel_lane: the lane splits (lanes.py).
        novel_first: empty the novel lane first (off: it competes on its score).
        adaptive_novel_first: empty the novel lane first only while its measured reuse
            probability (alpha) is at most every other non-empty lane's; otherwise it
            competes on its score.
        ghost_uses: a block cached again from a ghost starts at one hit (its re-cache
            was a reuse), so it joins a hit-count lane above the fresh blocks'.
        online_fit: fit the session gaps online (off: the paper's priors).
        gap_from_release: gaps from the previous turn's release (off: arrival to arrival).
        weighting: "reuse" (production), "efficiency" (the paper's) or "none" (alpha = 1).
        horizon_scoring: P(reuse within tau | age) (off: p S(age)); never with
            "efficiency" weights, which are not probabilities.
        structural_rate: structural blocks by decayed access count (off: by last use).
        strict_evict_first: evict from evict-first while it holds a candidate (the
            paper's rule): the lowest-scored of its lanes.
        efficiency_kwargs: temperature, alpha_ema, alpha_min, alpha_max of "efficiency".
        **kwargs: the production policy's tunables.
    """

    def __init__(self, session_queues: bool = True, split_agent: bool = True, structural: bool = True,
                 turn_lanes: bool = True, freq_lanes: bool = True, tail_lane: bool = True,
                 online_fit: bool = True, gap_from_release: bool = True, weighting: str = "reuse",
                 horizon_scoring: bool = True, structural_rate: bool = True, strict_evict_first: bool = False,
                 efficiency_kwargs: dict | None = None, ghost_uses: bool = False, novel_lane: bool = True,
                 novel_first: bool = True, adaptive_novel_first: bool = False, **kwargs):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}")
        self._placement_flags = (session_queues, split_agent, structural, turn_lanes, freq_lanes, tail_lane,
                                 novel_lane)
        self.online_fit, self.gap_from_release, self.weighting = online_fit, gap_from_release, weighting
        self.horizon_on = horizon_scoring and weighting != "efficiency"
        self.structural_rate, self.strict_evict_first = structural_rate, strict_evict_first
        self._efficiency_kwargs = efficiency_kwargs or {}
        self.ghost_uses, self.novel_first = ghost_uses, novel_first
        self.adaptive_novel_first = adaptive_novel_first
        super().__init__(**kwargs)
        args = {name: p.default for name, p in inspect.signature(UniCachePolicy.__init__).parameters.items()
                if name != "self"} | kwargs
        priors = list(self.weights.alpha)  # the production policy's priors, before any update
        self.placement = self._make_placement()
        self.weights = self._make_weights(priors, args["reuse_decay"], args["ghost_factor"], args["update_every"])
        self.gaps = self._make_gaps(args["fit_prior_weight"], args["max_sessions"])
        self.rate = self._make_rate(args["structural_rate_halflife_s"])

    def on_cached(self, block_id, block_hash, parent_id, now) -> None:
        ghost = self.weights.ghosts.get(block_hash)
        super().on_cached(block_id, block_hash, parent_id, now)
        if ghost is not None and self.ghost_uses:
            self._uses[block_id] = 1  # the re-cache is a reuse: the hit-count lanes see it

    def _make_placement(self) -> LanePlacement:
        return AblationPlacement(*self._placement_flags)

    def _make_weights(self, priors, decay, ghost_factor, update_every) -> ReuseWeights:
        if self.weighting == "efficiency":
            return EfficiencyWeights(priors, decay, ghost_factor, update_every, **self._efficiency_kwargs)
        if self.weighting == "none":
            return FixedWeights([1.0] * len(priors), decay, ghost_factor, update_every)
        return ReuseWeights(priors, decay, ghost_factor, update_every)

    def _make_gaps(self, prior_weight, max_sessions) -> SessionGaps:
        gaps = (SessionGaps if self.gap_from_release else ArrivalGaps)(prior_weight, max_sessions)
        if not self.online_fit:
            for fit in gaps.fits.values():
                fit.frozen = True
        return gaps

    def _make_rate(self, halflife_s: float) -> StructuralRate:
        return StructuralRate(halflife_s) if self.structural_rate else LastUseStructural()

    def on_request(self, cls: RequestClass, now: float) -> None:
        if isinstance(self.weights, EfficiencyWeights):
            self.weights.add_sizes(self._sizes)
        super().on_request(cls, now)

    def _score(self, lane: int, age: float) -> float:
        q = LANE_QUEUE[lane]
        if q == STRUCTURAL and self.structural_rate:
            return super()._score(lane, age)
        p, tau = self.weights.alpha[lane], self.residence.tau
        fit = self.rate.prior if q == STRUCTURAL else self.gaps.fit(q)
        if self.horizon_on:
            return horizon_score(p, fit, age, tau)
        return p * fit.survival(age)

    def _choose(self, scores: list[float]) -> int:
        if not self.novel_first:
            return scores.index(min(scores))  # the novel lane competes on its score
        if self.adaptive_novel_first and self._lane_sizes[_NOVEL]:
            alpha, sizes = self.weights.alpha, self._lane_sizes
            if any(sizes[lane] and alpha[lane] < alpha[_NOVEL] for lane in range(len(sizes)) if lane != _NOVEL):
                return scores.index(min(scores))  # novel blocks come back more than some lane's: compete
            return _NOVEL
        if self.strict_evict_first and self._sizes[EVICT_FIRST]:
            # The lowest-scored of the evict-first lanes (any of them, not only lane 0).
            first = EVICT_FIRST * NUM_LANES
            lanes = scores[first:first + NUM_LANES]
            return first + lanes.index(min(lanes))
        return super()._choose(scores)
