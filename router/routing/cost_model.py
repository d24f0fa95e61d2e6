"""Each backend's costs in seconds, learned live: prefill time against uncached tokens,
the wait per request outstanding ahead, and decode step time against batch size; one
shape fitted on the whole fleet, times each backend's speed where it differs beyond noise.

The router prices a routing decision in the fleet's own time (docs/routing.md, "cost
model"). Per backend r it keeps a robust windowed fit of

    ttft_r(u, q, o) = a_r + b_r * (u + q) + s_r * o       (seconds)
    itl_r(n)        = c_r + d_r * n                       (seconds per output token)

    u: the request's uncached prompt tokens (usage: prompt less cached tokens)
    q: the uncached prompt tokens queued ahead of it there, per prefill lane
    o: the requests outstanding there at dispatch (running, waiting and in transit)
    n: the batch a token was decoded in (requests running there)

from what the router sees on every request (its TTFT and usage, the load at dispatch,
the times between streamed messages) and, for stock vLLM servers, from their histograms
(``vllm:request_prefill_time_seconds``: pure prefill, o = q = 0;
``vllm:time_per_output_token_seconds``). ``a_r + b_r * u`` is the prefill of the uncached
part, ``b_r * q + s_r * o`` the time to drain what is running and queued there.

The fleet shares one shape and each backend has one speed (``FleetFit``): the fit of
``a, b, s`` (and of ``c, d``) is one Huber-weighted least squares over every backend's
last ``window`` observations together (ring buffers, so it follows change: after
``window`` observations of a new regime the old one is gone), and backend r's costs are
that shape times its scale k_r: how far the mean log ratio of its latest measured to
predicted times (the last eighth of its window) lies from the fleet's, soft-thresholded
by ``SCALE_Z`` standard errors (``speed_scale``). Two backends
that are alike are priced alike, whatever the noise of their few observations (fitted
apart, two identical vLLM servers had been given prefill bases of 0.069 s and 0.147 s
and one drew the traffic); a backend that is slower beyond noise (another GPU, a
throttled engine, a larger model) is priced slower by what it is beyond it. The price:
backends that differ in shape, not only in speed, share one shape.

The shape is refit every ``refit_every`` observations per backend with a fixed number of
reweighting rounds: O(window / refit_every) work per observation, amortised. A residual
beyond ``HUBER_K`` robust standard deviations (from the median absolute deviation)
weighs 1/|r|, so a stall or a cold start moves a coefficient little. A feature that does
not vary in the windows is not fitted: its coefficient stays at the prior and its part is
taken out of y first. Coefficients are never negative (a negative slope is set to 0 and
the rest refit). Until ``min_observations`` arrive from the fleet every backend's costs
are the prior ``PRIOR``; a backend with fewer of its own is priced as the fleet's shape
times the median speed of those with a speed (``FleetFit.typical_scale``), so a newcomer
is never priced out before it has answered enough to be judged.

A backend can also be slow without answering: a stalled or throttled engine holds the
requests sent to it, so its few answers arrive late or never and a fit of answers alone
cannot price it. The request path therefore reports each backend's longest overdue wait
(``set_overdue``): while a request there has waited for its first token longer than its
prediction by more than the fleet's noise (``overdue_threshold``: the median log ratio of
measured to predicted TTFT plus ``SCALE_Z`` robust standard deviations), its TTFT
costs are raised by the part beyond that noise. The wait is a lower bound on that
request's TTFT (it is censored), so the price only grows while it waits and falls back
when it is answered; a calibration and the fleet's fit never see it.

Invariants:
    * A backend's state is bounded: two ring buffers of ``window`` observations.
    * Backends whose speeds do not differ beyond noise (``SCALE_Z`` standard errors) have
      equal costs, exactly.
    * ``costs(r)`` never raises and never returns a negative coefficient.
    * An overdue factor is >= 1 and raises only the TTFT terms of ``costs(r)``, never
      ``to_calibration``, ``assigned`` or the fit.
    * ``uniform`` is True while nothing is fitted: every backend is priced alike, and
      ``cache_aware`` decides exactly as with prefill-token units (docs/routing.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import numpy as np

HUBER_K = 1.5  # residuals beyond this many robust standard deviations are down-weighted
SCALE_Z = 3.0  # a backend's speed differs from the fleet's beyond this many standard errors (a 0.3% false alarm)
_IRLS_ROUNDS = 4
MAD_TO_SD = 1.4826  # a normal distribution's standard deviation per median absolute deviation
CALIBRATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class Costs:
    """A backend's costs in seconds (module docstring's names).

    Attributes:
        prefill_base_s: a, the time to first token of a cached prompt on an idle backend.
        prefill_per_token_s: b, per uncached prompt token (its own and the queue's).
        per_outstanding_s: s, per request outstanding there at dispatch.
        decode_base_s / decode_per_seq_s: c and d of the inter-token time at batch n.
        fitted: False while these are a prior.
        observations: TTFT observations in the window.
    """

    prefill_base_s: float
    prefill_per_token_s: float
    per_outstanding_s: float
    decode_base_s: float = 0.02
    decode_per_seq_s: float = 0.001
    fitted: bool = False
    observations: int = 0

    def ttft_s(self, uncached: float, queued: float = 0.0, outstanding: float = 0.0) -> float:
        """Predicted time to first token (seconds)."""
        return self.prefill_base_s + self.prefill_per_token_s * (uncached + queued) + self.per_outstanding_s * outstanding

    def itl_s(self, batch: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def slower(self, factor: float) -> Costs:
        """These costs with every TTFT term times ``factor`` (the decode terms unchanged)."""
        return replace(self, prefill_base_s=factor * self.prefill_base_s,
                       prefill_per_token_s=factor * self.prefill_per_token_s,
                       per_outstanding_s=factor * self.per_outstanding_s)


# 2**-13 s per token (0.12 ms): a power of two, so pricing in it or in tokens orders and
# ties replicas alike, bit for bit. An outstanding request stands for 128 tokens
# (``CacheAwareConfig.request_cost_tokens``' default).
PRIOR = Costs(prefill_base_s=0.0, prefill_per_token_s=2.0 ** -13, per_outstanding_s=128 * 2.0 ** -13)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve m x = v (k <= 3) by Gaussian elimination with partial pivoting; None when singular."""
    k = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(k):
        piv = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) < 1e-12 * max(1.0, max(abs(x) for row in a for x in row[:k])):
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(k):
            if i != col and a[i][col]:
                f = a[i][col] / a[col][col]
                for j in range(col, k + 1):
                    a[i][j] -= f * a[col][j]
    return [a[i][k] / a[i][i] for i in range(k)]


class _Ring:
    """A backend's last ``window`` observations (x, y), oldest overwritten first.

    Invariant: at most ``window`` observations; ``count`` is every one accepted ever."""

    __slots__ = ("window", "_xs", "_ys", "_next", "count")

    def __init__(self, window: int):
        self.window = window
        self._xs: list[tuple[float, ...]] = []
        self._ys: list[float] = []
        self._next = 0
        self.count = 0

    def __len__(self) -> int:
        return len(self._ys)

    def add(self, x: Sequence[float], y: float) -> bool:
        """Keep (x, y); False (nothing kept) when a value is not finite."""
        if not (math.isfinite(y) and all(math.isfinite(v) for v in x)):
            return False
        row = tuple(float(v) for v in x)
        if len(self._ys) < self.window:
            self._xs.append(row)
            self._ys.append(float(y))
        else:
            self._xs[self._next] = row
            self._ys[self._next] = float(y)
            self._next = (self._next + 1) % self.window
        self.count += 1
        return True

    def recent(self, n: int) -> tuple[list[tuple[float, ...]], list[float]]:
        """The last ``n`` observations kept (x rows and y), oldest first."""
        xs, ys, k = self._xs, self._ys, self._next
        if len(ys) == self.window and k:
            xs, ys = xs[k:] + xs[:k], ys[k:] + ys[:k]
        return xs[-n:], ys[-n:]


def huber_fit(xs: np.ndarray, ys: np.ndarray, prior: Sequence[float]) -> list[float] | None:
    """Coefficients c of y = c[0] + sum_j c[j+1] * x[j] (module docstring's fit): Huber
    IRLS over the rows of ``xs``; a feature that does not vary keeps its ``prior`` and its
    part is taken out of y first, as does the last of features that vary only together
    (collinear); a negative slope is set to 0 and the rest refit; the intercept is clamped
    at 0. None when not even the intercept can be fitted (fewer than 3 rows)."""
    if len(ys) < 3:
        return None
    k = len(prior) - 1
    lo, hi = xs.min(axis=0), xs.max(axis=0)
    active = [j for j in range(k) if hi[j] - lo[j] > 1e-9 * max(1.0, abs(hi[j]))]
    zeroed: list[int] = []
    while True:
        coef = _irls(xs, ys, prior, active, zeroed)
        if coef is None:
            if not active:
                return None
            # features that vary together (every prompt alike: the queue ahead grows with
            # the requests ahead) cannot be told apart: the last keeps its prior
            active = active[:-1]
            continue
        neg = [j for j in active if coef[j + 1] < 0.0]
        if not neg:
            break
        active = [j for j in active if j not in neg]
        zeroed.extend(neg)
    coef[0] = max(0.0, coef[0])
    return coef


def _irls(xs: np.ndarray, ys: np.ndarray, prior: Sequence[float], active: list[int],
          zeroed: list[int]) -> list[float] | None:
    """Huber IRLS (``huber_fit``); the p x p normal equations are accumulated by numpy and
    solved by ``_solve``."""
    prior = [0.0 if j - 1 in zeroed else float(p) for j, p in enumerate(prior)]
    fixed = [j for j in range(len(prior) - 1) if j not in active]
    # y less the prior's share of the features not fitted
    yy = ys
    if fixed:
        yy = yy - xs[:, fixed] @ np.asarray([prior[j + 1] for j in fixed])
    rows = np.column_stack([np.ones(len(yy)), xs[:, active]])
    w = np.ones(len(yy))
    beta = None
    for _ in range(_IRLS_ROUNDS):
        wr = rows * w[:, None]
        sol = _solve((wr.T @ rows).tolist(), (wr.T @ yy).tolist())
        if sol is None:
            break
        beta = sol
        res = np.abs(yy - rows @ np.asarray(beta))
        scale = MAD_TO_SD * float(np.median(res))
        if scale <= 0.0:
            break
        cut = HUBER_K * scale
        w = np.where(res <= cut, 1.0, cut / np.maximum(res, cut))
    if beta is None:
        return None
    coef = list(prior)
    coef[0] = beta[0]
    for b, j in zip(beta[1:], active):
        coef[j + 1] = b
    return coef


def log_ratios(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """log(measured / predicted) of the rows where both are positive."""
    ok = (predicted > 1e-9) & (measured > 1e-9)
    return np.log(measured[ok] / predicted[ok])


class Moments(NamedTuple):
    """Count, sum and sum of squares of some values: what a mean and a variance need, and
    what can be taken off a total (``minus``)."""

    n: int
    total: float
    squares: float

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        return cls(len(values), float(values.sum()), float((values * values).sum()))

    def minus(self, other: Moments) -> Moments:
        return Moments(self.n - other.n, self.total - other.total, self.squares - other.squares)

    def mean(self) -> float:
        return self.total / self.n

    def var(self) -> float:
        """The sample variance (n - 1 in the denominator; never below 0)."""
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))


def speed_scale(own: Moments, rest: Moments, z: float = SCALE_Z) -> float:
    """How much slower (> 1) or faster (< 1) a backend is than the fleet: exp of the
    difference between the mean of its log ratios ``own`` (measured / the shape's
    prediction) and the fleet's (``own`` and ``rest`` together), soft-thresholded by ``z``
    standard errors of that difference: 1.0 unless it lies beyond the noise, else the
    part beyond it. A backend alone in the fleet, or one with fewer than 3 rows (or a
    rest of fewer than 2), has 1.0. Measured against the fleet's mean, not the shape's
    prediction, so what the robust shape leaves out for every backend alike (stalls)
    does not count as speed."""
    n, m = own.n, rest.n
    if n < 3 or m < 2:
        return 1.0
    diff = m / (n + m) * (own.mean() - rest.mean())  # own's mean less the fleet's
    se = m / (n + m) * math.sqrt(own.var() / n + rest.var() / m)
    excess = abs(diff) - z * se
    return math.exp(math.copysign(excess, diff)) if excess > 0.0 else 1.0


class FleetFit:
    """y ~ k_r * (c[0] + sum_j c[j+1] * x[j]): one shape ``coef`` for the whole fleet,
    fitted on every backend's window together, and one speed ``scale`` per backend
    (``speed_scale`` on each backend's latest ``speed_window`` observations), so identical
    backends are priced identically until their measurements differ beyond noise, and a
    backend that gets slower is priced so within ``speed_window`` answers.

    Refit every ``refit_every`` observations per backend (``refit_every`` times the
    number of backends in all), when the fleet reaches ``min_observations`` and when a
    backend does: O(window / refit_every) numpy work per observation, amortised.

    Invariants: ``coef`` holds len(prior) non-negative floats (the prior until
    ``fitted``); ``scales`` holds a positive float for each backend with
    ``min_observations`` or more, and only for those."""

    __slots__ = ("prior", "coef", "window", "refit_every", "min_observations", "speed_window", "rings", "scales",
                 "fitted", "noise", "_since", "count")

    def __init__(self, prior: Sequence[float], window: int = 128, refit_every: int = 8, min_observations: int = 16):
        if window < 4 or refit_every < 1 or min_observations < 1:
            raise ValueError("window must be >= 4, refit_every and min_observations >= 1")
        self.prior = tuple(float(p) for p in prior)
        self.coef = list(self.prior)
        self.window = window
        self.refit_every = refit_every
        self.min_observations = min_observations
        # a speed is judged on each backend's latest eighth of a window (at least
        # min_observations): a backend that slows, and so draws few requests, is priced so
        # within a dozen or two of its answers
        self.speed_window = max(min_observations, window // 8)
        self.rings: dict[str, _Ring] = {}
        self.scales: dict[str, float] = {}
        self.fitted = False
        # (median, robust standard deviation) of the log ratios of measured to the shape's
        # predicted values over every window at the last refit: one prediction's noise
        self.noise: tuple[float, float] | None = None
        self._since = 0
        self.count = 0  # observations ever, all backends

    def ring(self, rid: str) -> _Ring:
        r = self.rings.get(rid)
        if r is None:
            r = self.rings[rid] = _Ring(self.window)
        return r

    def add(self, rid: str, x: Sequence[float], y: float) -> bool:
        """One observation of ``rid``; True when it refit the fleet."""
        ring = self.ring(rid)
        if not ring.add(x, y):
            return False
        self.count += 1
        self._since += 1
        if (self._since >= self.refit_every * len(self.rings) or ring.count == self.min_observations
                or self.count == self.min_observations):
            self.refit()
            return True
        return False

    def forget(self, rid: str) -> None:
        self.rings.pop(rid, None)
        self.scales.pop(rid, None)

    def typical_scale(self) -> float:
        """The median of the backends' speeds (1.0 while none has one): what a backend
        without enough observations of its own is priced at."""
        if not self.scales:
            return 1.0
        return float(np.median(list(self.scales.values())))

    def refit(self) -> None:
        """The fleet's shape on every window, then each fitted backend's scale."""
        self._since = 0
        if self.count < self.min_observations:
            return
        rings = [r for r in self.rings.values() if len(r)]
        if not rings:
            return
        xs = np.asarray([x for r in rings for x in r._xs], dtype=float)
        ys = np.asarray([y for r in rings for y in r._ys], dtype=float)
        coef = huber_fit(xs, ys, self.prior)
        if coef is None:
            return
        self.coef, self.fitted = coef, True
        c = np.asarray(coef[1:])
        # NOTE: robust (median, MAD): a stall or a cold start in the window would widen a
        # standard deviation until no wait counted as overdue
        lr = log_ratios(coef[0] + xs @ c, ys)
        if len(lr) >= 3:
            center = float(np.median(lr))
            self.noise = (center, MAD_TO_SD * float(np.median(np.abs(lr - center))))
        moments = {}
        for rid, r in self.rings.items():
            if len(r):
                recent_xs, recent_ys = r.recent(self.speed_window)
                moments[rid] = Moments.of(log_ratios(coef[0] + np.asarray(recent_xs, dtype=float) @ c,
                                                     np.asarray(recent_ys, dtype=float)))
        # the fleet's totals once; each backend's rest is the totals less its own: O(fleet)
        fleet = Moments(sum(m.n for m in moments.values()), sum(m.total for m in moments.values()),
                        sum(m.squares for m in moments.values()))
        self.scales = {rid: speed_scale(own, fleet.minus(own)) for rid, own in moments.items()
                       if self.rings[rid].count >= self.min_observations}


@dataclass(slots=True)
class _Errors:
    abs_error_s: float = 0.0  # EMA of |predicted - measured TTFT|
    rel_error: float = 0.0  # EMA of |predicted - measured| / measured
    errors: int = 0


class CostModel:
    """Per-backend ``Costs``, learned from observations (module docstring): the fleet's
    shape times each backend's speed (``FleetFit``), for TTFT and for decode.

    Args:
        window: observations each backend's window keeps (default 128).
        refit_every: observations per backend between refits (default 8).
        min_observations: TTFT observations before the fleet's fit replaces the prior, and
            before a backend gets a speed of its own (default 16).
        prior: the costs before anything is fitted (``PRIOR``).
        frozen: observations are ignored (a calibration: ``from_calibration``).
    """

    def __init__(self, window: int = 128, refit_every: int = 8, min_observations: int = 16,
                 prior: Costs = PRIOR, frozen: bool = False):
        if min_observations < 1:
            raise ValueError("min_observations must be >= 1")
        self.window = window
        self.refit_every = refit_every
        self.min_observations = min_observations
        self.prior = prior
        self.frozen = frozen
        p = prior
        self._ttft = FleetFit((p.prefill_base_s, p.prefill_per_token_s, p.per_outstanding_s), window, refit_every,
                              min_observations)
        self._itl = FleetFit((p.decode_base_s, p.decode_per_seq_s), window, refit_every, min_observations)
        self._errors: dict[str, _Errors] = {}
        self._fixed: dict[str, Costs] = {}  # a calibration's costs
        self._overdue: dict[str, float] = {}  # set_overdue: factors > 1 only
        self._cache: dict[str, Costs] | None = None
        self._priced: dict[str, Costs] | None = None  # _cache with the overdue factors
        self._fleet: Costs | None = None

    # -- observations --------------------------------------------------------------------
    def observe_ttft(self, rid: str, ttft_s: float, uncached: float, queued: float = 0.0, outstanding: float = 0.0) -> None:
        """A request's measured TTFT on ``rid`` with its uncached prompt tokens, the
        uncached tokens queued ahead per lane and the requests outstanding at dispatch."""
        if self.frozen or ttft_s < 0:
            return
        if self._ttft.add(rid, (uncached + queued, outstanding), ttft_s):
            self._invalidate()

    def observe_prefill(self, rid: str, prefill_s: float, uncached: float) -> None:
        """A pure prefill time (no queue, nothing outstanding ahead): vLLM's
        ``request_prefill_time_seconds`` mean over a poll against its mean uncached tokens."""
        self.observe_ttft(rid, prefill_s, uncached, 0.0, 0.0)

    def observe_itl(self, rid: str, itl_s: float, batch: float) -> None:
        """A mean time per output token, decoded in batches of about ``batch``."""
        if self.frozen or itl_s < 0:
            return
        if self._itl.add(rid, (batch,), itl_s):
            self._invalidate()

    def observe_error(self, rid: str, predicted_s: float, measured_s: float) -> None:
        """Record the prediction error of one TTFT (exponential average, weight 1/16)."""
        if measured_s <= 0:
            return
        b = self._errors.get(rid)
        if b is None:
            b = self._errors[rid] = _Errors()
        err = abs(predicted_s - measured_s)
        w = 1.0 / 16 if b.errors >= 16 else 1.0 / (b.errors + 1)
        b.abs_error_s += w * (err - b.abs_error_s)
        b.rel_error += w * (err / measured_s - b.rel_error)
        b.errors += 1

    def overdue_threshold(self) -> float | None:
        """The log of measured / predicted TTFT beyond which one request's wait is more
        than the fleet's noise: the median log ratio of the fleet's windows plus ``SCALE_Z``
        robust standard deviations (1.4826 x the median absolute deviation). None while
        the fleet's TTFT is not fitted (its predictions are the prior's, not seconds) or
        is frozen."""
        noise = self._ttft.noise
        if self.frozen or not self._ttft.fitted or noise is None:
            return None
        return noise[0] + SCALE_Z * noise[1]

    def set_overdue(self, factors: Mapping[str, float]) -> None:
        """Each backend's overdue factor (module docstring), replacing the last: its TTFT
        costs are multiplied by it; a backend not named (or with a factor <= 1) has none.
        Ignored by a frozen model."""
        if self.frozen:
            return
        new = {rid: float(f) for rid, f in factors.items() if f > 1.0}
        if new != self._overdue:
            self._overdue = new
            self._priced = None

    def overdue(self, rid: str) -> float:
        """``rid``'s overdue factor (1.0: none)."""
        return self._overdue.get(rid, 1.0)

    def forget(self, rid: str) -> None:
        known = (rid in self._ttft.rings or rid in self._itl.rings or rid in self._fixed
                 or rid in self._overdue)
        self._ttft.forget(rid)
        self._itl.forget(rid)
        self._errors.pop(rid, None)
        self._fixed.pop(rid, None)
        self._overdue.pop(rid, None)
        if known:
            self._invalidate()

    # -- reading -------------------------------------------------------------------------
    def _invalidate(self) -> None:
        self._cache = None
        self._priced = None

    def _fitted(self) -> dict[str, Costs]:
        if self._cache is None:
            out = dict(self._fixed)
            ttft, itl = self._ttft, self._itl
            (a, pb, s), (c, d) = ttft.coef, itl.coef
            for rid, k in ttft.scales.items():
                if rid not in out:
                    ki = itl.scales.get(rid, 1.0)
                    out[rid] = Costs(k * a, k * pb, k * s, ki * c, ki * d, True, len(ttft.rings[rid]))
            self._cache = out
            if ttft.fitted:
                # a backend without a speed of its own yet is priced as the fleet's typical one
                # (the median speed): priced at the bare shape, a newcomer whose few first
                # answers were slow (a cold engine) stood above a fast-measured peer and drew
                # nothing more, so it never got the answers that would have priced it
                k, ki = ttft.typical_scale(), itl.typical_scale()
                self._fleet = Costs(k * a, k * pb, k * s, ki * c, ki * d, False, 0)
            elif out:
                n = len(out)
                vals = list(out.values())
                self._fleet = Costs(sum(c.prefill_base_s for c in vals) / n, sum(c.prefill_per_token_s for c in vals) / n,
                                    sum(c.per_outstanding_s for c in vals) / n, sum(c.decode_base_s for c in vals) / n,
                                    sum(c.decode_per_seq_s for c in vals) / n, False, 0)
            else:
                self._fleet = None
        return self._cache

    def _with_overdue(self) -> dict[str, Costs]:
        """``_fitted`` with each overdue backend's costs raised (a backend without costs
        of its own: the fleet's, raised); the same dict while nothing is overdue."""
        if self._priced is None:
            fitted = self._fitted()
            if self._overdue and self._fleet is not None:
                priced = dict(fitted)
                for rid, f in self._overdue.items():
                    priced[rid] = fitted.get(rid, self._fleet).slower(f)
                self._priced = priced
            else:
                self._priced = fitted
        return self._priced

    @property
    def uniform(self) -> bool:
        """Nothing is fitted: every backend is priced with one prior."""
        return not self._fitted() and self._fleet is None

    def costs(self, rid: str) -> Costs:
        """``rid``'s fitted costs, else the fleet's (its shape times the median speed, or
        a calibration's mean), else the prior; times its overdue factor, if any."""
        c = self._with_overdue().get(rid)
        if c is not None:
            return c
        return self._fleet if self._fleet is not None else self.prior

    def speed(self, rid: str) -> float:
        """``rid``'s TTFT scale against the fleet's shape (1.0 until it differs beyond noise)."""
        return self._ttft.scales.get(rid, 1.0)

    def backends(self) -> list[str]:
        return sorted(set(self._ttft.rings) | set(self._itl.rings) | set(self._errors) | set(self._fixed))

    def error(self, rid: str) -> tuple[float, float, int]:
        """(mean absolute error s, mean relative error, predictions scored) of ``rid``."""
        b = self._errors.get(rid)
        return (b.abs_error_s, b.rel_error, b.errors) if b is not None else (0.0, 0.0, 0)

    def snapshot(self) -> dict[str, dict]:
        """Per backend: its costs, whether fitted, and its prediction error (for
        ``/v1/cluster/state``, the dashboard and the calibration file)."""
        out = {}
        for rid in self.backends():
            c = self.costs(rid)
            row = asdict(c)
            row["fitted"] = rid in self._fitted()
            row["overdue_factor"] = self.overdue(rid)
            ae, re_, n = self.error(rid)
            row.update(ttft_abs_error_s=ae, ttft_rel_error=re_, predictions=n)
            out[rid] = row
        return out

    def mean_costs(self) -> Costs:
        """The fleet's costs: the fitted shape times the median speed, else a
        calibration's mean, else the prior."""
        self._fitted()
        return self._fleet if self._fleet is not None else self.prior

    def assigned(self, replica_ids: Sequence[str]) -> CostModel:
        """A frozen model in which ``replica_ids[i]`` has the costs of the i-th fitted
        backend (by id, cycling when there are fewer): a calibration taken on one fleet,
        priced onto the replicas of another (the simulator's ``r0``, ``r1``, ...)."""
        fitted = sorted(self._fitted().items())
        model = CostModel(frozen=True, prior=self.prior)
        if fitted:
            for i, rid in enumerate(replica_ids):
                model._fixed[rid] = fitted[i % len(fitted)][1]
        model._invalidate()
        return model

    # -- calibration files ------------------------------------------------------------------
    def to_calibration(self) -> dict:
        """A calibration: the fitted backends' costs (``from_calibration`` reads it)."""
        return {"version": CALIBRATION_VERSION,
                "backends": {rid: asdict(c) for rid, c in sorted(self._fitted().items())}}

    @classmethod
    def from_calibration(cls, data: Mapping | str, frozen: bool = True) -> CostModel:
        """A model whose backends have the calibration's costs (``data``: the dict or a
        JSON file's path). Raises ValueError naming what is wrong."""
        if isinstance(data, str):
            try:
                with open(data, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"cannot read calibration {data}: {exc}") from None
        if not isinstance(data, Mapping) or data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"a calibration is a JSON object with \"version\": {CALIBRATION_VERSION} and \"backends\"")
        backends = data.get("backends")
        if not isinstance(backends, Mapping):
            raise ValueError("calibration: \"backends\" must map backend ids to costs")
        model = cls(frozen=frozen)
        names = ("prefill_base_s", "prefill_per_token_s", "per_outstanding_s", "decode_base_s", "decode_per_seq_s")
        for rid, row in backends.items():
            if not isinstance(row, Mapping):
                raise ValueError(f"calibration: backend {rid!r} is not an object")
            vals = {}
            for name in names:
                v = row.get(name, getattr(PRIOR, name))
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"calibration: backend {rid!r}: {name} must be a non-negative number, got {v!r}")
                vals[name] = float(v)
            model._fixed[str(rid)] = Costs(**vals, fitted=True, observations=int(row.get("observations", 0) or 0))
        model._invalidate()
        return model
