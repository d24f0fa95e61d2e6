"""UniCache's lane scores: the probability that a lane's head is reused while it could stay.

Session and evict-first lanes: with reuse probability p (the lane's weight) and gap
survival S (its queue's log-normal fit), a block of age a that has not been reused yet
is reused within the cache's residence time tau with probability

    p (S(a) - S(a + tau)) / (1 - p + p S(a)),

instead of the paper's p S(a) (reuse at any later time): a block whose reuse is likely
but far away is worth less than one likely to be reused soon.

Structural lanes: a template block's reuse is a Poisson stream whose rate comes from its
decayed access count c = sum_i 2^(-(now - t_i)/h) (LRFU's CRF; a stream of rate r has
E[c] = r h / ln 2); the score is p (1 - exp(-r tau)). The heap key is the count written
as an effective time E (c = 2^((E - now)/h)), which all blocks age alike, so heap order
is score order; an evicted block's E rides in the ghost list and is resumed when the
block is cached again (frequency history across evictions, as in TinyLFU): a hot
template that paused outlives a cold one used once more recently.
"""

from __future__ import annotations

import math

from unicache.replica.eviction.lognormal import OnlineLogNormal

_LN2 = math.log(2.0)


def horizon_score(p: float, fit: OnlineLogNormal, age: float, tau: float) -> float:
    """P(reuse within ``tau`` | not reused by ``age``), reuse probability ``p``."""
    s_now = fit.survival(age)
    return p * (s_now - fit.survival(age + tau)) / (1.0 - p + p * s_now + 1e-12)


class ResidenceTime:
    """tau: how long a block stays cached after its last use, as an EMA of victims' ages.

    Args:
        scale: tau = scale * the EMA.
        initial_s: the EMA before any victim (seconds).
    """

    def __init__(self, scale: float = 1.0, initial_s: float = 60.0):
        if scale <= 0 or initial_s <= 0:
            raise ValueError("need horizon_scale > 0")
        self.scale = scale
        self.ema = initial_s
        self._victims, self._age_sum = 0, 0.0  # since the last fold

    @property
    def tau(self) -> float:
        return self.scale * self.ema

    def note(self, victims: int, age_sum: float) -> None:
        """``victims`` blocks left, their ages since last use summing to ``age_sum``."""
        self._victims += victims
        self._age_sum += age_sum

    def fold(self) -> None:
        """Fold the victims noted since the last fold into the EMA (weight 0.01 each)."""
        if self._victims:
            decay = 0.99**self._victims
            self.ema = decay * self.ema + (1.0 - decay) * self._age_sum / self._victims
            self._victims, self._age_sum = 0, 0.0


class StructuralRate:
    """Decayed access counts of structural blocks, as effective times, and their score.

    Invariants:
        * ``effective`` holds a time only for blocks released into a structural lane
          (or cached again from a structural ghost) and loses it on ``forget``.

    Args:
        halflife_s: h of the decayed count.
    """

    def __init__(self, halflife_s: float = 120.0):
        if halflife_s <= 0:
            raise ValueError("structural_rate_halflife_s must be positive")
        self.halflife = halflife_s
        self.effective: dict[int, float] = {}

    def key(self, block_id: int, now: float) -> float:
        """Heap key of a block released into a structural lane: its effective time
        (``now`` at its first release, which follows its caching within one request)."""
        return self.effective.setdefault(block_id, now)

    def on_access(self, block_id: int, now: float) -> None:
        eff = self.effective
        if block_id in eff:
            eff[block_id] = self._combine(eff[block_id], now)

    def resume(self, block_id: int, ghost_key: float, now: float) -> None:
        """A block cached again from a structural ghost keeps its access history."""
        self.effective[block_id] = self._combine(ghost_key, now)

    def forget(self, block_id: int) -> None:
        self.effective.pop(block_id, None)

    def score(self, p: float, age: float, tau: float) -> float:
        """p P(reuse within tau) at rate r = c ln2 / h, c = 2^(-age/h) (age = now - E)."""
        h = self.halflife
        rate = math.exp(-age * _LN2 / h) * _LN2 / h
        return p * -math.expm1(-rate * tau)

    def _combine(self, e: float, t: float) -> float:
        """Effective time after one more access at ``t``: h log2(2^(e/h) + 2^(t/h))."""
        h = self.halflife
        hi, lo = (e, t) if e >= t else (t, e)
        return hi + h * math.log1p(math.exp((lo - hi) * _LN2 / h)) / _LN2
