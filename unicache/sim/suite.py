"""A workload suite for routing studies: families of generated mixes plus Mooncake slices.

One generator (``unicache.sim.workload``) at one setting says little about traffic it was
not tuned on. The suite draws every knob of the generator from wide ranges, grouped into
*families* by what dominates the traffic:

    * ``chat``: chat sessions carry 60-90% of the requests;
    * ``agent``: agent sessions carry 60-90%;
    * ``template``: templated single-turn requests carry 60-90%;
    * ``plain``: unique single-turn prompts carry 50-80% (little to reuse);
    * ``balanced``: every source 15-35%;
    * ``long``: balanced shares, every prompt and output length x2-4;
    * ``mooncake``: time slices of the Mooncake conversation trace (not generated).

Within every generated family all other knobs are drawn too: tenants 1-16, session
lengths (chat 2-12 turns, agent 3-20), gap distributions (chat log-normal mu 1.5-5.5,
sigma 0.5-1.8; agent mu 0-3, sigma 0.5-1.5), agent prompts 1-8, template counts 3-200
with Zipf skew 0.5-1.6, and every prompt and output length over about a decade. Shares
are shares of *requests*: a session source's start rate is its share of
``requests_per_s`` divided by its mean turns.

A *point* is one knob setting, drawn from ``(family, point)`` alone; a *trace* is a point
plus a generator seed. ``tune`` and ``report`` roles use disjoint points and seeds (and
disjoint Mooncake slices), so defaults chosen on the tuning traces are reported on traces
they never saw.

Invariants:
    * ``draw_config(family, point, seed)`` is a pure function of its arguments.
    * Tuning and report traces never share a point or a Mooncake slice.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from unicache.sim.trace import TraceRequest
from unicache.sim.workload import WorkloadConfig

GENERATED_FAMILIES = ("chat", "agent", "template", "plain", "balanced", "long")
MOONCAKE = "mooncake"
FAMILIES = (*GENERATED_FAMILIES, MOONCAKE)
SOURCES = ("chat", "agent", "template", "plain")

# (low, high, log-uniform?) for every knob the families share.
KNOB_RANGES: dict[str, tuple[float, float, bool]] = {
    "tenants": (1, 16, True),
    "chat_turns_mean": (2.0, 12.0, True),
    "chat_gap_mu": (1.5, 5.5, False),
    "chat_gap_sigma": (0.5, 1.8, False),
    "chat_system_tokens": (100, 1500, True),
    "chat_user_tokens": (40, 500, True),
    "chat_output_tokens": (50, 600, True),
    "agent_turns_mean": (3.0, 20.0, True),
    "agent_gap_mu": (0.0, 3.0, False),
    "agent_gap_sigma": (0.5, 1.5, False),
    "agent_prompts": (1, 8, True),
    "agent_system_tokens": (500, 6000, True),
    "agent_tool_tokens": (150, 2000, True),
    "agent_output_tokens": (40, 400, True),
    "templates": (3, 200, True),
    "template_zipf": (0.5, 1.6, False),
    "template_tokens": (200, 4000, True),
    "template_suffix_tokens": (30, 600, True),
    "template_output_tokens": (30, 500, True),
    "plain_tokens": (200, 4000, True),
    "plain_output_tokens": (50, 600, True),
}
LENGTH_KNOBS = tuple(k for k in KNOB_RANGES if k.endswith("_tokens"))

# Share ranges per family: (dominant source or None, its range, the others' range).
_SHARES: dict[str, tuple[str | None, tuple[float, float], tuple[float, float]]] = {
    "chat": ("chat", (0.6, 0.9), (0.1, 1.0)),
    "agent": ("agent", (0.6, 0.9), (0.1, 1.0)),
    "template": ("template", (0.6, 0.9), (0.1, 1.0)),
    "plain": ("plain", (0.5, 0.8), (0.1, 1.0)),
    "balanced": (None, (0.0, 0.0), (0.15, 0.35)),
    "long": (None, (0.0, 0.0), (0.15, 0.35)),
}
_LONG_FACTOR = (2.0, 4.0)


@dataclass(slots=True, frozen=True)
class SuiteTrace:
    """One trace of the suite: a generated point + seed, or a Mooncake slice."""

    family: str
    role: str  # "tune" or "report"
    point: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.family}-p{self.point}-s{self.seed}"


def _draw(rng: random.Random, lo: float, hi: float, log: bool) -> float:
    if log:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.uniform(lo, hi)


def _shares(family: str, rng: random.Random) -> dict[str, float]:
    dominant, dom_range, rest_range = _SHARES[family]
    if dominant is None:
        raw = {s: rng.uniform(*rest_range) for s in SOURCES}
        total = sum(raw.values())
        return {s: v / total for s, v in raw.items()}
    dom = rng.uniform(*dom_range)
    raw = {s: rng.uniform(*rest_range) for s in SOURCES if s != dominant}
    total = sum(raw.values())
    out = {s: (1.0 - dom) * v / total for s, v in raw.items()}
    out[dominant] = dom
    return out


def draw_config(family: str, point: int, seed: int, duration: float = 600.0, requests_per_s: float = 1.5,
                block_size: int = 16) -> WorkloadConfig:
    """The generator setting of ``family``'s point ``point``, with generator seed ``seed``.

    Args:
        family: one of ``GENERATED_FAMILIES``.
        point: which point of the family (its knobs depend on ``(family, point)`` only).
        seed: the generator's seed (arrivals and lengths).
        duration: seconds of arrivals (default 600).
        requests_per_s: mean requests per second over all sources (default 1.5).
        block_size: tokens per block (default 16).
    """
    if family not in _SHARES:
        raise ValueError(f"unknown generated family {family!r} (choose from {', '.join(GENERATED_FAMILIES)})")
    rng = random.Random(f"{family}/{point}")
    knobs: dict[str, float | int] = {}
    for name, (lo, hi, log) in KNOB_RANGES.items():
        v = _draw(rng, lo, hi, log)
        knobs[name] = int(round(v)) if isinstance(WorkloadConfig.__dataclass_fields__[name].default, int) else v
    if family == "long":
        factor = rng.uniform(*_LONG_FACTOR)
        for name in LENGTH_KNOBS:
            knobs[name] = int(knobs[name] * factor)
    shares = _shares(family, rng)
    rates = {
        "chat_rate": shares["chat"] * requests_per_s / knobs["chat_turns_mean"],
        "agent_rate": shares["agent"] * requests_per_s / knobs["agent_turns_mean"],
        "template_rate": shares["template"] * requests_per_s,
        "plain_rate": shares["plain"] * requests_per_s,
    }
    return WorkloadConfig(seed=seed, duration=duration, block_size=block_size, **knobs, **rates)


def suite_traces(points: int = 2, seeds: int = 2, tune_points: int = 1, tune_seeds: int = 1,
                 mooncake_slices: tuple[int, int] = (1, 1), families: Sequence[str] = FAMILIES) -> list[SuiteTrace]:
    """Every trace of the suite, tuning traces first.

    Generated families: report points ``0..points-1`` x seeds ``0..seeds-1``; tuning points
    ``1000..`` x seeds ``1000..`` (disjoint). Mooncake: ``mooncake_slices`` = (tuning
    slices, report slices); tuning slices come first in time, then report slices.
    """
    out: list[SuiteTrace] = []
    for role, (n_pts, n_seeds, base) in (("tune", (tune_points, tune_seeds, 1000)), ("report", (points, seeds, 0))):
        for fam in families:
            if fam == MOONCAKE:
                n_tune, n_rep = mooncake_slices
                idx = range(n_tune) if role == "tune" else range(n_tune, n_tune + n_rep)
                out += [SuiteTrace(fam, role, i, 0) for i in idx]
                continue
            out += [SuiteTrace(fam, role, base + p, base + s) for p in range(n_pts) for s in range(n_seeds)]
    return out


def mooncake_slice(trace: Sequence[TraceRequest], index: int, slices: int) -> list[TraceRequest]:
    """Slice ``index`` of ``slices`` equal time windows of a (timestamp-sorted) trace,
    timestamps shifted to start at 0."""
    if not 0 <= index < slices:
        raise ValueError(f"slice {index} of {slices}")
    return mooncake_window(trace, index, index + 1, slices)


def mooncake_window(trace: Sequence[TraceRequest], start: int, stop: int, slices: int) -> list[TraceRequest]:
    """Slices ``start`` to ``stop - 1`` of ``slices`` equal time windows, as one trace
    (timestamps shifted to start at 0)."""
    if not 0 <= start < stop <= slices:
        raise ValueError(f"slices {start}..{stop - 1} of {slices}")
    if not trace:
        return []
    t0, t1 = trace[0].timestamp_ms, trace[-1].timestamp_ms
    width = (t1 - t0) / slices or 1.0
    lo, hi = t0 + start * width, t0 + stop * width
    last = stop == slices
    picked = [r for r in trace if lo <= r.timestamp_ms < hi or (last and r.timestamp_ms == hi)]
    if not picked:
        return []
    first = picked[0].timestamp_ms
    return [replace(r, index=i, timestamp_ms=r.timestamp_ms - first) for i, r in enumerate(picked)]


def load_suite_trace(st: SuiteTrace, block_size: int = 16, mooncake_path: str | None = None,
                     mooncake_block_size: int = 512, mooncake_slices: int = 4, duration: float = 600.0,
                     requests_per_s: float = 1.5):
    """Prepare ``st`` for replay (a ``PreparedTrace``): generated families go through
    ``write_trace``/``read_trace`` exactly as a ``gen-workload`` file would; Mooncake slices
    are cut from ``mooncake_path`` (classes inferred: the trace has no labels)."""
    import tempfile
    from pathlib import Path

    from unicache.sim.prepare import prepare
    from unicache.sim.workload import generate
    from unicache.sim.trace import read_trace, write_trace

    if st.family == MOONCAKE:
        if mooncake_path is None:
            raise ValueError("the mooncake family needs mooncake_path")
        return prepare(mooncake_slice(read_trace(mooncake_path), st.point, mooncake_slices), mooncake_block_size)
    cfg = draw_config(st.family, st.point, st.seed, duration=duration, requests_per_s=requests_per_s,
                      block_size=block_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{st.name}.jsonl"
        write_trace(path, generate(cfg))
        return prepare(read_trace(path), block_size)


def offered_prefill_s_per_s(trace, timing) -> float:
    """Prefill seconds per second of arrivals if nothing were cached and nothing batched:
    the trace's load, used to put every trace's rate grid at the same utilisation."""
    reqs = trace.requests
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) if len(reqs) > 1 else 0.0
    work = sum(timing.prefill_s(1, r.input_length) for r in reqs)
    return work / span if span > 0 else work
