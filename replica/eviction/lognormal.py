"""Online log-normal fit of reuse gaps (one per UniCache queue).

The fit keeps exponentially decayed sums of log(gap) and log(gap)^2, seeded with a prior
worth ``prior_weight`` observations, so it starts at the prior and follows the workload.

Invariants:
    * ``sigma >= min_sigma > 0`` and ``weight <= max_weight`` (old gaps fade out).
    * ``survival`` is 1 at age <= 0 and decreases monotonically with age, so a queue
      ordered by last use is ordered by survival too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_SQRT2 = math.sqrt(2.0)


@dataclass(slots=True)
class OnlineLogNormal:
    """Log-normal distribution of gaps in seconds, fitted online.

    Args:
        mu: prior mean of log(gap).
        sigma: prior standard deviation of log(gap).
        prior_weight: pseudo-observations the prior is worth.
        max_weight: the fit's memory; beyond it, older gaps are down-weighted.
        min_sigma: floor on sigma (a single repeated gap must not make a step function).
        frozen: keep the prior (no learning; for ablations).
    """

    mu: float
    sigma: float
    prior_weight: float = 20.0
    max_weight: float = 5000.0
    min_sigma: float = 0.25
    frozen: bool = False
    weight: float = 0.0
    _s1: float = 0.0
    _s2: float = 0.0

    def __post_init__(self) -> None:
        if self.sigma <= 0 or self.prior_weight <= 0 or self.max_weight < self.prior_weight:
            raise ValueError("need sigma > 0 and 0 < prior_weight <= max_weight")
        self.weight = self.prior_weight
        self._s1 = self.mu * self.prior_weight
        self._s2 = (self.sigma**2 + self.mu**2) * self.prior_weight

    def observe(self, gap: float) -> None:
        """Add one observed gap (seconds). Non-positive gaps are clamped to 1 ms."""
        if self.frozen:
            return
        x = math.log(gap if gap > 1e-3 else 1e-3)
        if self.weight + 1.0 > self.max_weight:
            keep = (self.max_weight - 1.0) / self.weight
            self._s1 *= keep
            self._s2 *= keep
            self.weight *= keep
        self._s1 += x
        self._s2 += x * x
        self.weight += 1.0
        mu = self._s1 / self.weight
        var = self._s2 / self.weight - mu * mu
        self.mu = mu
        self.sigma = max(self.min_sigma, math.sqrt(var) if var > 0 else 0.0)

    def survival(self, age: float) -> float:
        """P(gap > age) = 1 - CDF(age)."""
        if age <= 0:
            return 1.0
        return 0.5 * math.erfc((math.log(age) - self.mu) / (self.sigma * _SQRT2))
