"""Bootstrap confidence intervals for the live A/B, and the verdict they give: a
difference between two arms inside both intervals is a tie.

Single runs of a CPU fleet decide nothing (issue 43: one round put ours at TTFT p50 51 ms
against round robin's 33; three rounds made them a tie). So every figure the A/B compares
comes with a percentile bootstrap interval over its requests, pooled over the
interleaved rounds: ``B`` resamples with replacement of the (arm, rate)'s successful
requests, the statistic recomputed on each, the interval the ``(1 - level) / 2`` and
``(1 + level) / 2`` quantiles of those. The hit ratio's statistic is the
prompt-token-weighted ratio of the requests' cached to prompt tokens (their usage), so it
resamples like the latencies. Seeded: the same runs give the same intervals.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from unicache.sim.metrics import percentile

RESAMPLES = 1000
LEVEL = 0.95


def bootstrap_ci(items: Sequence, stat: Callable[[Sequence], float], resamples: int = RESAMPLES, level: float = LEVEL,
                 seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of ``stat`` over ``items`` (None: no items)."""
    n = len(items)
    if not n:
        return None
    rng = random.Random(seed)
    values = sorted(stat([items[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    lo = values[int((1 - level) / 2 * (resamples - 1))]
    hi = values[int(round((1 + level) / 2 * (resamples - 1)))]
    return lo, hi


def ttft_ci(ttfts: Sequence[float], q: float, **kw) -> tuple[float, float] | None:
    """The interval of the TTFT ``q``-th percentile."""
    return bootstrap_ci(list(ttfts), lambda xs: percentile(list(xs), q), **kw)


def hit_ratio_ci(pairs: Sequence[tuple[int, int]], **kw) -> tuple[float, float] | None:
    """The interval of sum(cached) / sum(prompt) over (cached, prompt tokens) pairs."""
    def ratio(xs):
        prompt = sum(p for _, p in xs)
        return sum(c for c, _ in xs) / prompt if prompt else 0.0

    return bootstrap_ci(list(pairs), ratio, **kw)


def verdict(a: tuple[float, float] | None, b: tuple[float, float] | None, lower_is_better: bool) -> str:
    """``a`` against ``b``: "better", "worse", or "tie" when the intervals overlap
    (or either is missing)."""
    if a is None or b is None or not (a[1] < b[0] or b[1] < a[0]):
        return "tie"
    a_lower = a[1] < b[0]
    return "better" if a_lower == lower_is_better else "worse"
