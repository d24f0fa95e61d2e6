"""Goodput: the highest arrival-rate scale at which TTFT p90 stays within an SLO.

A replay at ``rate_scale`` s divides every arrival time by s (``ReplayConfig``). For one
(router, policy, capacity) the replays at several scales give points (s, TTFT p90);
goodput is where p90 first crosses the SLO:

    * scales are taken in increasing order; the last scale before the first one whose
      p90 exceeds the SLO passes, and goodput lies between it and the failing scale:
      interpolated linearly in log(scale) on p90 (``goodput_rate_scale``);
    * if the lowest scale already fails, goodput is 0.0; if every scale passes, it is
      the highest scale and ``saturated`` is True (a lower bound: a wider grid could
      find more).

The default SLO is ``slo_factor`` (3) times the unloaded TTFT of the trace's median
request: on the lanes model the prefill time of one request of the median prompt length,
alone, nothing cached (``TimingModel.prefill_s(1, median input_length)``); a service
model with another notion of unloaded passes its own (``unloaded_ttft``, e.g.
``unicache.sim.steps.unloaded_ttft_s``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from unicache.sim.metrics import percentile
from unicache.sim.prepare import PreparedTrace
from unicache.sim.timing import TimingModel

DEFAULT_SLO_FACTOR = 3.0


def lanes_unloaded_ttft_s(timing: TimingModel, input_length: int) -> float:
    """TTFT of a request alone on an idle lanes-model replica with nothing cached."""
    return timing.prefill_s(1, input_length)


def unloaded_median_ttft_s(trace: PreparedTrace, timing: TimingModel,
                           unloaded_ttft: Callable[[TimingModel, int], float] = lanes_unloaded_ttft_s) -> float:
    """``unloaded_ttft`` of the median-length request (nearest rank; it grows with the
    prompt, so this is also the median of every request's)."""
    median = percentile([r.input_length for r in trace.requests], 50.0)
    return unloaded_ttft(timing, int(median)) if not math.isnan(median) else 0.0


def default_slo_s(trace: PreparedTrace, timing: TimingModel, factor: float = DEFAULT_SLO_FACTOR,
                  unloaded_ttft: Callable[[TimingModel, int], float] = lanes_unloaded_ttft_s) -> float:
    return factor * unloaded_median_ttft_s(trace, timing, unloaded_ttft)


@dataclass(slots=True, frozen=True)
class Goodput:
    """``rate_scale``: the goodput; ``saturated``: every tested scale passed."""

    rate_scale: float
    saturated: bool


def goodput(points: Iterable[tuple[float, float]], slo_s: float) -> Goodput:
    """Goodput from (rate_scale, ttft_p90_s) points (see the module docstring).

    A NaN p90 (nothing admitted) fails. ValueError on no points or a non-positive scale.
    """
    pts = sorted(points)
    if not pts:
        raise ValueError("goodput needs at least one (rate_scale, p90) point")
    if pts[0][0] <= 0:
        raise ValueError("rate scales must be positive")
    prev: tuple[float, float] | None = None
    for scale, p90 in pts:
        if not p90 <= slo_s:  # NaN fails
            if prev is None:
                return Goodput(0.0, False)
            s0, p0 = prev
            if math.isnan(p90):
                return Goodput(s0, False)
            frac = (slo_s - p0) / (p90 - p0)
            return Goodput(math.exp(math.log(s0) + frac * (math.log(scale) - math.log(s0))), False)
        prev = (scale, p90)
    return Goodput(pts[-1][0], True)


def group_key(r: dict) -> tuple:
    """What one goodput is computed over: every result with the same policy, capacity and
    router (pooled runs are their own router)."""
    return (r["policy"], r["capacity_blocks"], r.get("router"))


def add_goodput(results: Sequence[dict], slo_s: float) -> list[dict]:
    """Set ``goodput_rate_scale``, ``goodput_saturated`` and ``goodput_slo_s`` on every
    result, per ``group_key`` over its ``rate_scale``s; returns one summary per group
    (first-seen order)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(group_key(r), []).append(r)
    out = []
    for (policy, cap, router), rs in groups.items():
        g = goodput(((r["rate_scale"], r["ttft_p90_s"]) for r in rs), slo_s)
        for r in rs:
            r.update(goodput_rate_scale=g.rate_scale, goodput_saturated=g.saturated, goodput_slo_s=slo_s)
        entry = {"policy": policy, "capacity_blocks": cap, "goodput_rate_scale": g.rate_scale,
                 "goodput_saturated": g.saturated, "slo_s": slo_s}
        if router is not None:
            entry["router"] = router
        out.append(entry)
    return out
