"""How ``cache_aware`` should decide that a replica is too busy: a fixed balance ratio or
estimated TTFT, and how much queued work should cost.

``cache_aware`` used to admit a replica only while its outstanding requests stayed within
``balance_ratio`` (1.5) x the mean (or the minimum + 4), then minimise a token cost. The
ratio counts decoding requests, which do not delay a prefill, and ignores what a cached
prefix saves; on the suite's 8-replica report it cost 2-4 token-hit points against
sglang's near-pure locality. The alternative measured here is TTFT admission
(``unicache.router.routing.admission``): a replica is admissible while its estimated
TTFT (uncached prompt tokens + queued prefill tokens / prefill lanes) is within
``admission_factor`` x the best replica's. Each variant is a set of ``CacheAwarePolicy``
keyword arguments (``VARIANTS``); the balance-ratio guard is the ``ratio`` variant
(``RatioGuardPolicy`` below, this study's own subclass, never registered).

Tuning traces only, disjoint from ``bench.routing_report``'s report traces: generated
families at suite points 1000.. with seed 1000 (the report uses points 0-1, seeds 0-1),
and Mooncake slices 0..k of 8 (inside the report's tuning slice 0 of 4; it reports slice
1 of 4). The points are split in two halves (A: even offsets, B: odd offsets) so the
table shows whether a variant's gain holds on points its choice did not see.

Per trace, replica count (4 and 8) and variant: goodput in u and metrics at u = 0.5 by
the report's own machinery (``bench.routing_report.run_job``: same capacity, SLO, load
units and goodput search), against sglang + unicache and sglang + lru on the same trace.
Scores: geometric mean of per-trace goodput ratios vs sglang + unicache (paired per
trace), mean token-hit points vs sglang + unicache, max load imbalance at u = 0.5.

Writes ``routing_admission.{json,md,png}`` to ``--out-dir``.

Run (from the repository root, niced; about 15 minutes on 2 shared CPUs):
    nice -n 10 .venv/bin/python -m bench.studies.routing_admission [--points 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, save_figure, write_report
from bench.routing_report import GOODPUT_FLOOR_U, Job, add_suite_args, parse_suite_args, run_jobs
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.suite import FAMILIES, GENERATED_FAMILIES, MOONCAKE, SuiteTrace

MOONCAKE_SLICES = 8  # slices 0..k of 8 lie inside slice 0 of 4, the report's tuning slice
TUNE_BASE = 1000
# The generated tuning points after the four every default was chosen on (the routing
# report's --tune-points): a study's options for checking a choice on tuning traces it was
# not made on (``bench.studies.load_weight``, ``fresh_points``; Mooncake has no unused
# tuning slice).
UNUSED_TUNING_POINTS = {"first_point": 4, "points": 8, "families": ",".join(GENERATED_FAMILIES)}
SGL_UC, SGL_LRU = "sglang+unicache", "sglang+lru"


class RatioGuardPolicy(CacheAwarePolicy):
    """``cache_aware`` with the fixed balance guard instead of TTFT admission: admissible
    while ``outstanding <= max(min + balance_slack, balance_ratio * mean)`` (the rule
    ``cache_aware`` shipped before this study; not registered, built through
    ``ReplayConfig.router_factory``)."""

    def __init__(self, balance_ratio: float = 1.5, balance_slack: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.balance_ratio = balance_ratio
        self.balance_slack = balance_slack

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        loads = [r.outstanding for r in replicas]
        cap = max(min(loads) + self.balance_slack, self.balance_ratio * sum(loads) / len(loads))
        return [r for r in replicas if r.outstanding <= cap]


NO_GUARD = 1e9  # a balance ratio no load reaches: every replica admissible (an admission
# factor cannot say it: a replica holding the whole prompt with nothing queued estimates 0)
# name -> (router class, CacheAwarePolicy keyword arguments)
VARIANTS: dict[str, tuple[type[CacheAwarePolicy], dict]] = {
    "ratio 1.5, load 1 (old default)": (RatioGuardPolicy, {}),
    "no guard, load 1": (RatioGuardPolicy, {"balance_ratio": NO_GUARD}),
    "no guard, load 0.5": (RatioGuardPolicy, {"balance_ratio": NO_GUARD, "load_weight": 0.5}),
    "ttft 1.5, load 0.25": (CacheAwarePolicy, {"admission_factor": 1.5, "load_weight": 0.25}),
    "ttft 2, load 0.25": (CacheAwarePolicy, {"admission_factor": 2.0, "load_weight": 0.25}),
    "ttft 2, load 1": (CacheAwarePolicy, {"admission_factor": 2.0}),
    "ttft 3, load 1": (CacheAwarePolicy, {"admission_factor": 3.0}),
}
BASE = "ratio 1.5, load 1 (old default)"


def tuning_traces(points: int, mooncake_slices: int, families: Sequence[str] = FAMILIES,
                  first_point: int = 0) -> list[SuiteTrace]:
    """Generated points ``TUNE_BASE + first_point`` onwards, ``points`` of them (seed
    ``TUNE_BASE``; tuning points all, never a report point), and Mooncake slices
    ``0..mooncake_slices-1`` of ``MOONCAKE_SLICES``."""
    if mooncake_slices > MOONCAKE_SLICES // 4:
        raise ValueError(f"at most {MOONCAKE_SLICES // 4} Mooncake slices stay inside the report's tuning slice")
    if first_point < 0:
        raise ValueError(f"first_point {first_point} < 0")
    out = [SuiteTrace(f, "tune", TUNE_BASE + first_point + p, TUNE_BASE) for f in families
           if f in GENERATED_FAMILIES for p in range(points)]
    if MOONCAKE in families:
        out += [SuiteTrace(MOONCAKE, "tune", i, 0) for i in range(mooncake_slices)]
    return out


def half(t: dict) -> str:
    """Which half of the tuning points a trace belongs to (A: even offset, B: odd)."""
    return "A" if (int(t["trace"].split("-p")[1].split("-")[0]) % 2 == 0) else "B"


def _lg(row: dict) -> float:
    return math.log(max(row["goodput_u"], GOODPUT_FLOOR_U))


def summarise(results: list[dict], n: str) -> dict:
    """Per variant: overall and per family goodput ratio vs sglang+unicache (geo mean of
    paired per-trace ratios), the same vs the old default, token-hit points vs
    sglang+unicache, max imbalance, mean TTFT p90/p99 at u_ref."""
    fams = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    out: dict[str, dict] = {}
    for v in [*VARIANTS, SGL_LRU]:
        def agg(rs: list[dict]) -> dict | None:
            if not rs:
                return None
            rows = [r["by_replicas"][n]["rows"] for r in rs]
            return {
                "goodput_vs_sglang_unicache": math.exp(statistics.mean(_lg(x[v]) - _lg(x[SGL_UC]) for x in rows)),
                "goodput_vs_sglang_lru": math.exp(statistics.mean(_lg(x[v]) - _lg(x[SGL_LRU]) for x in rows)),
                "goodput_vs_base": math.exp(statistics.mean(_lg(x[v]) - _lg(x[BASE]) for x in rows)),
                "hit_pts_vs_sglang_unicache": 100 * statistics.mean(
                    x[v]["at_u_ref"]["token_hit_ratio"] - x[SGL_UC]["at_u_ref"]["token_hit_ratio"] for x in rows),
                "imbalance_max": max(x[v]["at_u_ref"]["load_imbalance"] for x in rows),
                "ttft_p90_s": statistics.mean(x[v]["at_u_ref"]["ttft_p90_s"] for x in rows),
                "ttft_p99_s": statistics.mean(x[v]["at_u_ref"]["ttft_p99_s"] for x in rows),
                "traces": len(rows),
            }
        out[v] = {"all": agg(results), "A": agg([r for r in results if half(r) == "A"]),
                  "B": agg([r for r in results if half(r) == "B"]),
                  "families": {f: agg([r for r in results if r["family"] == f]) for f in fams}}
    return out


def markdown(report: dict) -> str:
    lines = [
        "# cache_aware admission: fixed balance ratio vs TTFT estimate (tuning traces only)\n",
        f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs, {report['workers']} workers) "
        f"at commit {report['commit']}; {report['wall_s'] / 60:.1f} min wall.\n",
        f"Tuning traces ({len(report['traces'])}): {', '.join(report['traces'])}. None is a report trace of "
        "`bench.routing_report`. Goodput ratios are geometric means of paired per-trace ratios; hit points and "
        "TTFT at u = 0.5; halves A/B split the points (even/odd offsets) to show whether a gain carries over.\n",
    ]
    for n, s in report["summary"].items():
        lines += [f"## {n} replicas\n",
                  "| variant | goodput / sglang+uc (all, A, B) | / sglang+lru | / old default | hit pts vs sglang+uc "
                  "| imbalance max | p90 s | p99 s |", "|---|---|---|---|---|---|---|---|"]
        for v, d in s.items():
            a = d["all"]
            halves = ", ".join(f"{d[h]['goodput_vs_sglang_unicache']:.3f}" if d[h] else "-" for h in "AB")
            lines.append(f"| {v} | {a['goodput_vs_sglang_unicache']:.3f} ({halves}) | {a['goodput_vs_sglang_lru']:.3f} "
                         f"| {a['goodput_vs_base']:.3f} | {a['hit_pts_vs_sglang_unicache']:+.2f} "
                         f"| {a['imbalance_max']:.2f} | {a['ttft_p90_s']:.3f} | {a['ttft_p99_s']:.3f} |")
        fams = list(next(iter(s.values()))["families"])
        lines += ["", "Per family: goodput / sglang+unicache, hit points vs sglang+unicache, max imbalance.\n",
                  "| variant | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
        for v, d in s.items():
            lines.append(f"| {v} | " + " | ".join(
                f"{d['families'][f]['goodput_vs_sglang_unicache']:.2f} / {d['families'][f]['hit_pts_vs_sglang_unicache']:+.1f} "
                f"/ {d['families'][f]['imbalance_max']:.2f}" for f in fams) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    names = list(VARIANTS)
    width = 0.38
    for i, (n, s) in enumerate(report["summary"].items()):
        ax.bar([x + i * width for x in range(len(names))], [s[v]["all"]["goodput_vs_sglang_unicache"] for v in names],
               width, label=f"{n} replicas")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks([x + width / 2 for x in range(len(names))], names, rotation=20, fontsize=7, ha="right")
    ax.set_ylabel("goodput / sglang+unicache\n(geo mean over tuning traces)")
    ax.set_title("cache_aware admission variants, tuning traces")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


@dataclass(slots=True, frozen=True)
class TuningRun:
    """A routing study's parsed command line: its tuning traces and the replay settings
    every job shares (``common``), as ``bench.routing_report``'s ``Job`` takes them."""

    args: argparse.Namespace
    families: list[str]
    traces: list
    common: dict


def parse_tuning_run(doc: str, argv: list[str] | None, defaults: dict | None = None,
                     variants: Sequence[str] | None = None) -> TuningRun:
    """The command line of the routing studies on tuning traces (this one and
    ``bench.studies.routing_balance``): which traces, how long, how many replicas.
    ``defaults``: a study's own defaults for these options (dest -> value);
    ``variants``: the study's variant names, selectable with ``--variants a,b``
    (``args.variants``: the chosen names, None for all)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(ap)
    ap.add_argument("--points", type=int, default=4, help="tuning points per generated family (default 4)")
    ap.add_argument("--first-point", type=int, default=0,
                    help="offset of the first tuning point (default 0: the points every default was chosen on; "
                         "4 onwards: UNUSED_TUNING_POINTS)")
    ap.add_argument("--mooncake-slices", type=int, default=2, help=f"Mooncake slices 0..k-1 of {MOONCAKE_SLICES}")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--requests-per-s", type=float, default=1.5)
    ap.add_argument("--capacity-frac", type=float, default=0.02)
    if variants is not None:
        ap.add_argument("--variants", default=None,
                        help="comma-separated variants to run besides the reference (default: all): " + ", ".join(variants))
    ap.set_defaults(**(defaults or {}))
    args = parse_suite_args(ap, argv)
    if variants is not None and args.variants is not None:
        args.variants = [v for v in args.variants.split(",") if v]
        unknown = [v for v in args.variants if v not in variants]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: " + ", ".join(variants))
    families = [f for f in args.families.split(",") if f]
    common = {"mooncake": args.trace, "mooncake_slices": MOONCAKE_SLICES, "duration": args.duration,
              "requests_per_s": args.requests_per_s, "capacity_frac": args.capacity_frac, "u_ref": 0.5}
    return TuningRun(args, families, tuning_traces(args.points, args.mooncake_slices, families, args.first_point), common)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    run = parse_tuning_run(__doc__, argv)
    args, traces, common = run.args, run.traces, run.common
    configs = tuple((v, "cache_aware", "unicache") for v in VARIANTS) + (
        (SGL_UC, "sglang", "unicache"), (SGL_LRU, "sglang", "lru"))
    replicas = tuple(int(x) for x in args.replicas.split(","))
    kwargs = {v: kw for v, (_, kw) in VARIANTS.items()}
    factories = {v: cls for v, (cls, _) in VARIANTS.items()}
    jobs = [Job(t, replicas, configs, kwargs, common, factories) for t in traces]
    results = run_jobs(jobs, args.workers)
    report = {
        "command": "python -m bench.studies.routing_admission " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(),
        "traces": [t.name for t in traces],
        "variants": {v: {"class": cls.__name__, "kwargs": kw} for v, (cls, kw) in VARIANTS.items()}, "capacity_frac": args.capacity_frac,
        "summary": {str(n): summarise(results, str(n)) for n in replicas},
        "results": results, "wall_s": time.perf_counter() - t0,
    }
    out_dir = Path(args.out_dir)
    write_report(out_dir, "routing_admission", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
