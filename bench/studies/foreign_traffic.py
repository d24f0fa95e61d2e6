"""cache_aware on traffic from another generator: does the shipped default win where no
default was chosen?

Every default of ``cache_aware`` was chosen on traces of the project's own generator
(``unicache.sim.workload``, swept by the routing suite) and a Mooncake slice. This study
replays traces of a generator written apart from it (``bench.foreign_workload``: power-law
chat sessions with regenerations and edits, RAG over a shared corpus, fan-out agent
swarms, few-shot templates whose popularity drifts, long unique documents, bursty
arrivals) through the routing report's machinery (``bench.routing_report.run_job``: the
same capacity rule, SLO rule, goodput search and u_ref). Nothing is tuned here: the
shipped default runs against sglang + unicache, sglang + lru and the pooled replica, and
the report gives the issue's targets per dominant source (``family_summary``) and over all
traces, with a paired 95% bootstrap interval for each goodput ratio.

Traces are seeds ``--first-seed`` .. ``+ --seeds - 1`` (each seed draws its source shares and
knobs: ``bench.foreign_workload.draw_knobs``); a trace's family is its dominant source.
The SLO is the report's (3 x the unloaded TTFT of the median request) unless the trace's
unloaded p90 request alone exceeds it, as on a quarter of these traces (long documents,
long system prompts): then 3 x the unloaded p90 request's, the rule the report applies to
Mooncake for the same reason (under the median rule no router has any goodput there).

``--variants name:key=value&key=value`` (repeatable; JSON values, as ``bench.fleet_scale``'s
``--policies``) adds ``cache_aware`` settings beside the shipped one, each reported against
the baselines and against the shipped default.

Writes ``foreign_traffic.{json,md,png}`` to ``--out-dir``.

Run (from the repository root, niced; about 10 min with 2 workers):
    nice -n 10 .venv/bin/python -m bench.studies.foreign_traffic [--seeds 24] [--replicas 4,8]
        [--variants 'inflight:track_inflight=true' --out-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

from bench.fleet_scale import policy_spec
from bench.foreign_workload import BLOCK_SIZE, SOURCES, draw_knobs, foreign_trace_files
from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, produced_by, save_figure, write_report
from bench.routing_report import (
    GOODPUT_FLOOR_U, POOLED, POOLED_LABEL, Job, code_default_candidate, family_summary, run_jobs, target_table,
)
from bench.studies.variant_study import _lg, bootstrap_ci95
from unicache.sim.prepare import PreparedTrace, prepare
from unicache.sim.suite import SuiteTrace
from unicache.trace import read_trace
BASELINES = ("sglang+unicache", "sglang+lru")


def foreign_trace(seed: int) -> SuiteTrace:
    """Trace ``seed`` of the study, its family the dominant source (``foreign-chat``, ...)."""
    return SuiteTrace(f"foreign-{draw_knobs(seed).dominant}", "report", seed, seed)


def load_foreign(st: SuiteTrace, args: dict) -> PreparedTrace:
    """``Job.loader``: generate the trace, write and read it as a trace file (so it passes the
    trace reader's checks), prepare it with its labels."""
    with foreign_trace_files([st.seed], args["duration"], BLOCK_SIZE, args["requests_per_s"]) as files:
        return prepare(read_trace(files[0][2]), BLOCK_SIZE)


def overall(results: list[dict], ours: str, n: str, others: tuple[str, ...] = (*BASELINES, POOLED_LABEL)) -> dict:
    """Over every trace at ``n`` replicas: ``ours`` against each of ``others`` (geometric
    mean of per-trace goodput ratios, floored at ``GOODPUT_FLOOR_U``, with its paired 95%
    bootstrap interval; traces above / below)."""
    out = {}
    for other in others:
        logs = [_lg(r["by_replicas"][n]["rows"][ours]) - _lg(r["by_replicas"][n]["rows"][other]) for r in results]
        lo, hi = bootstrap_ci95(logs)
        out[other] = {"goodput_ratio": math.exp(sum(logs) / len(logs)), "ci95": [lo, hi],
                      "above": sum(x > 0 for x in logs), "below": sum(x < 0 for x in logs)}
    return out


def token_hit_pts(results: list[dict], label: str, n: str) -> float:
    """``label``'s token hit ratio minus sglang + unicache's at u_ref, points, mean over traces."""
    rows = [r["by_replicas"][n]["rows"] for r in results]
    return 100 * sum(x[label]["at_u_ref"]["token_hit_ratio"] - x["sglang+unicache"]["at_u_ref"]["token_hit_ratio"]
                     for x in rows) / len(rows)


def markdown(report: dict) -> str:
    ours = report["ours"]
    lines = [
        "# cache_aware on traffic from another generator", "",
        produced_by(report), "",
        f"{report['traces']} traces of `bench.foreign_workload` (seeds {report['seeds'][0]}-{report['seeds'][-1]}, "
        f"{report['duration']:.0f} s, {report['requests_per_s']} requests/s on average), none used to choose anything. "
        f"Ours: `{ours}` (the shipped default). Capacity, goodput search and u_ref "
        f"({report['u_ref']}) as in `bench.routing_report`; the SLO too, but 3 x the unloaded p90 request's TTFT "
        f"where that request alone exceeds 3 x the median's ({report['slo_p90_traces']} traces; the report's "
        "Mooncake rule).", "",
        "## Over all traces", "",
        "Goodput of ours against each (geometric mean of per-trace ratios, paired 95% bootstrap interval; "
        "traces above / below):", "",
        "| replicas | " + " | ".join(f"vs {o}" for o in (*BASELINES, POOLED_LABEL))
        + " | token hit pts vs sglang+unicache: ours / pooled |",
        "|---|" + "---|" * (len(BASELINES) + 2),
    ]
    def cell(v: dict) -> str:
        return f"**{v['goodput_ratio']:.3f}x** ({v['ci95'][0]:.3f}-{v['ci95'][1]:.3f}; {v['above']} / {v['below']})"

    for n, o in report["overall"].items():
        hits = report["token_hit_pts"][n]
        lines.append(f"| {n} | " + " | ".join(map(cell, o.values())) + f" | {hits['ours']:+.2f} / {hits['pooled']:+.2f} |")
    if report["variants"]:
        lines += ["", "Variants (goodput against the shipped default and sglang + unicache; token hit points "
                  "against sglang + unicache, mean over traces at u_ref):", "",
                  "| variant | settings | replicas | vs shipped | vs sglang+unicache | token hit pts |", "|---|---|---|---|---|---|"]
        for label, v in report["variants"].items():
            for n, o in v["overall"].items():
                lines.append(f"| {label} | `{v['kwargs']}` | {n} | {cell(o[ours])} | {cell(o['sglang+unicache'])} | "
                             f"{v['token_hit_pts'][n]:+.2f} |")
    table, met, total = target_table(report["families"], traces=True)
    lines += ["", "## By dominant source (the routing report's targets)", "", *table]
    lines += ["", f"Targets met: {met} of {total} checks (targets: goodput >= 1.3 x sglang + lru and >= 1.1 x "
              "sglang + unicache; TTFT p90 and p99 <= both; token hit >= sglang + unicache - 0.5 points; "
              "load imbalance <= 1.2).", "",
              "## Per trace (goodput u: ours / sglang+unicache / sglang+lru)", "",
              "| trace | requests | SLO s | " + " | ".join(f"{n} replicas" for n in report["replicas"]) + " |",
              "|---|---|---|" + "---|" * len(report["replicas"])]
    for r in report["results"]:
        cells = []
        for n in map(str, report["replicas"]):
            rows = r["by_replicas"][n]["rows"]
            cells.append(" / ".join(f"{rows[k]['goodput_u']:.3f}" for k in (ours, *BASELINES)))
        p90 = " (p90 rule)" if r["slo_rule"] != "3 x unloaded median request" else ""
        lines.append(f"| {r['trace']} | {r['requests']} | {r['slo_s']:.3f}{p90} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Per-trace goodput ratio of ours over each sglang baseline, sorted, per replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = report["ours"]
    fig, axes = plt.subplots(1, len(report["replicas"]), figsize=(5.2 * len(report["replicas"]), 3.8), squeeze=False)
    for ax, n in zip(axes[0], map(str, report["replicas"])):
        for other, color in zip(BASELINES, ("tab:blue", "tab:orange")):
            ratios = sorted(max(r["by_replicas"][n]["rows"][ours]["goodput_u"], GOODPUT_FLOOR_U)
                            / max(r["by_replicas"][n]["rows"][other]["goodput_u"], GOODPUT_FLOOR_U)
                            for r in report["results"])
            ax.plot(range(1, len(ratios) + 1), ratios, "o-", ms=3, color=color, label=f"ours / {other}")
        for y, style in ((1.0, "-"), (1.1, ":"), (1.3, "--")):
            ax.axhline(y, color="grey", lw=0.8, ls=style)
        ax.set_yscale("log")
        ax.set_xlabel("trace (sorted by ratio)")
        ax.set_ylabel("goodput ratio")
        ax.set_title(f"{n} replicas")
        ax.legend(fontsize=8)
    fig.suptitle("cache_aware (shipped default) on bench.foreign_workload traces")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=24, help="traces (default 24)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (at most 2 on the shared machine)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per trace (default 300)")
    ap.add_argument("--requests-per-s", type=float, default=1.5)
    ap.add_argument("--capacity-frac", type=float, default=0.02)
    ap.add_argument("--u-ref", type=float, default=0.5)
    ap.add_argument("--variants", action="append", default=[],
                    help="a cache_aware setting beside the shipped one: name:key=value&key=value (repeatable)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    try:
        variants = {name: kw for name, kw in map(policy_spec, args.variants)}
    except ValueError as e:
        ap.error(f"--variants: {e}")
    if args.seeds < 2:
        ap.error("--seeds must be at least 2 (the interval resamples traces)")
    try:
        replicas = tuple(int(x) for x in args.replicas.split(","))
    except ValueError:
        ap.error("--replicas takes comma-separated integers")
    t0 = time.perf_counter()
    default = code_default_candidate() or "default"
    ours = f"cache_aware[{default}]+unicache"
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    common = {"duration": args.duration, "requests_per_s": args.requests_per_s, "capacity_frac": args.capacity_frac,
              "u_ref": args.u_ref, "slo_p90_fallback": True}
    cfgs = [(ours, "cache_aware", "unicache"), ("sglang+unicache", "sglang", "unicache"),
            ("sglang+lru", "sglang", "lru"), (POOLED_LABEL, POOLED, "unicache")]
    labels = {name: f"cache_aware[{name}]+unicache" for name in variants}
    cfgs += [(label, "cache_aware", "unicache") for label in labels.values()]
    kwargs = {labels[name]: kw for name, kw in variants.items()}
    print(f"{len(seeds)} traces x {len(cfgs)} configs x replicas {replicas}", file=sys.stderr)
    jobs = [Job(foreign_trace(s), replicas, tuple(cfgs), kwargs, common, loader=load_foreign) for s in seeds]
    results = run_jobs(jobs, args.workers)
    families = {}
    for fam in (f"foreign-{s}" for s in SOURCES):
        rs = [r for r in results if r["family"] == fam]
        if rs:
            families[fam] = {str(n): dict(family_summary(rs, ours, str(n)), traces=len(rs)) for n in replicas}
    report = {
        "command": "python -m bench.studies.foreign_traffic " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(),
        "seeds": seeds, "traces": len(seeds), "duration": args.duration, "requests_per_s": args.requests_per_s,
        "capacity_frac": args.capacity_frac, "u_ref": args.u_ref, "replicas": list(replicas), "ours": ours,
        "overall": {str(n): overall(results, ours, str(n)) for n in replicas},
        "token_hit_pts": {str(n): {"ours": token_hit_pts(results, ours, str(n)),
                                   "pooled": token_hit_pts(results, POOLED_LABEL, str(n))} for n in replicas},
        "variants": {name: {"kwargs": variants[name],
                            "overall": {str(n): overall(results, label, str(n), (ours, "sglang+unicache")) for n in replicas},
                            "token_hit_pts": {str(n): token_hit_pts(results, label, str(n)) for n in replicas}}
                     for name, label in labels.items()},
        "families": families, "results": results,
        "slo_p90_traces": sum(r["slo_rule"] != "3 x unloaded median request" for r in results), "wall_s": time.perf_counter() - t0,
    }
    write_report(Path(args.out_dir), "foreign_traffic", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
