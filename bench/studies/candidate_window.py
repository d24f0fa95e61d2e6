"""cache_aware's candidate window at fleet scale (issue 17): what weighing the replicas
that could hit the prompt plus a moving window of W others
(``router/routing/candidates.py``) costs the routing, against weighing every replica.

The window exists for the decision's cost: with every replica weighed, the decision for a
prompt no replica holds grows with the fleet (about 0.8 ms at 1,024 replicas on this
machine, ``bench.fleet_scale``), with a window it costs what a fleet of W does. Fleets of at
most W replicas are unchanged, so only fleets of 256 and 1,024 are run here.

The default W was fixed by rules written before each run, in three rounds on tuning
workloads only (generated mixes of seeds 201-204 and second-generator seeds 100-103, which
no report uses):
    1. The window alone (without the least-queued replica), on mix 201 at 256 and 1,024
       replicas: the default is the smallest of 32, 64 and 128 whose token hit ratio is
       within 0.5 points of the full pass and whose TTFT mean and p99 are at most 1.05x
       the full pass's, on both. None was (at 256 replicas TTFT mean 1.06-1.22x, p99
       1.19-1.54x; at 1,024 all three better than the full pass): results in
       ``candidate_window_tuning_window_only.md``, at 797affd (the
       "+dirty" there: a docstring edit during the run).
    2. With the least-queued replica among the candidates (the shipped form), on mixes
       201-204 at 256 replicas and 201-202 at 1,024 (one replay each is chaotic: the
       window at 64 with four clock offsets gave TTFT mean 1.04-1.22x on mix 201 at 256):
       the default is the smallest of 32, 64 and 128 whose geometric mean, over the six
       workloads, of its TTFT mean and p99 ratios to the full pass are at most 1.05, and
       whose token hit ratio is on average within 0.5 points of the full pass's; if none
       is, the window is off by default.
    3. With a prefix more than half the fleet holds grouped (``LocalityView
       .prefix_match_groups``: its holders weighed only where the window or another
       reason brings them in; before, every holder was weighed, and a system prompt on
       every replica made the decision cost 1-4 ms at 1,024 replicas), window 32: the
       grouping is kept if window 32 still passes round 2's rule over the same six
       workloads against the full pass (``--out .../candidate_window_tuning_groups``).
       On those mixes no prefix is held by more than half the fleet, so the grouping
       never applied (window 32 decided exactly as in round 2). So, written before its
       run: on traces of the second generator (``bench.foreign_workload``, tuning seeds
       100-103, which no report uses; tenants' system prompts drawn from a Zipf pool, so
       popular ones spread over most replicas) at 256 replicas (1,200 s at 12 requests/s
       replayed at rate x 4, 1% of unique blocks per replica), window 32 with the
       grouping must pass round 2's rule against the full pass
       (``--workloads shared``), else the grouping is removed.
       Result: window 32 passed (1.000x / 1.000x, -0.00 points), but no decision there
       grouped a prefix either (``grouped_decisions`` 0): the grouping is exercised only
       by the report's Mooncake replay (every prompt there begins with one system-prompt
       block) and by ``bench.fleet_scale``'s rows; it has no parameter of its own (the
       half-fleet threshold is the window's existing fallback).
The report workloads are those of ``bench.studies.churn_window_fleet`` (Mooncake at 1,024
replicas, mix seed 200 at 256 and 1,024), run after the choice and used for nothing else.

Each cell is one simulated replay (unicache eviction, ``unicache sim``'s defaults
otherwise) in a worker process; ``cpu_s`` is the worker's CPU time for the replay (the
whole simulator, routing included).

    .venv/bin/python -m bench.studies.candidate_window [--jobs 2] [--windows 0,32,64,128]
        [--workloads tuning,shared,report] [--out bench/results/candidate_window]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from bench.foreign_workload import foreign_trace_files
from bench.mix_traces import prepared_mix
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import git_commit
from unicache.router.index import LocalityIndex
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs
from unicache.trace import read_trace

MIX_DURATION_S = 3600.0
FOREIGN_DURATION_S, FOREIGN_REQUESTS_PER_S = 1200.0, 12.0
# workload -> (trace: "mooncake" or a mix seed, block size, replicas, capacity blocks per replica, rate scale)
TUNING = {
    **{f"mix{seed}@256": (seed, 16, 256, 400, 16) for seed in (201, 202, 203, 204)},
    **{f"mix{seed}@1024": (seed, 16, 1024, 100, 64) for seed in (201, 202)},
}
# traces of the second generator (source "foreign:SEED"); capacity None: 1% of unique blocks
SHARED = {f"foreign{seed}@256": (f"foreign:{seed}", 16, 256, None, 4) for seed in (100, 101, 102, 103)}
REPORT = {
    "mooncake@1024": ("mooncake", 512, 1024, 200, 64),
    "mix200@256": (200, 16, 256, 400, 16),
    "mix200@1024": (200, 16, 1024, 100, 64),
}
FIELDS = ("token_hit_ratio", "load_imbalance", "ttft_mean_s", "ttft_p90_s", "ttft_p99_s")
HIT_TOLERANCE_PTS = 0.5
TTFT_TOLERANCE = 1.05


@functools.lru_cache(maxsize=2)  # a worker process replays one workload's windows on one preparation
def _trace(source, block_size: int):
    if source == "mooncake":
        return prepare(read_trace(mooncake_trace()), block_size)
    if str(source).startswith("foreign:"):
        with foreign_trace_files([int(source.split(":")[1])], FOREIGN_DURATION_S, block_size,
                                 requests_per_s=FOREIGN_REQUESTS_PER_S) as ((_, _, path),):
            return prepare(read_trace(path), block_size)
    return prepared_mix(int(source), MIX_DURATION_S, block_size)[0]


def run_cell(workload: str, spec: tuple, window: int) -> tuple[str, int, dict]:
    """One replay of ``workload`` with ``candidate_window=window``."""
    source, block_size, replicas, capacity, rate = spec
    trace = _trace(source, block_size)
    if capacity is None:
        capacity = capacities_from_fracs([0.01], trace.unique_blocks)[0]
    config = ReplayConfig(policy="unicache", capacity_blocks=capacity, replicas=replicas, router="cache_aware",
                          router_kwargs={"candidate_window": window}, rate_scale=float(rate))
    grouped = [0]  # decisions where a prefix held by more than half the fleet was grouped
    walk = LocalityIndex.prefix_match_groups

    def counting(self, block_hashes, wide):
        deep, groups = walk(self, block_hashes, wide)
        grouped[0] += bool(groups)
        return deep, groups

    LocalityIndex.prefix_match_groups = counting
    try:
        t0 = time.process_time()
        result = Replay(trace, config).run()
        cpu = time.process_time() - t0
    finally:
        LocalityIndex.prefix_match_groups = walk
    return workload, window, {**{k: result[k] for k in FIELDS}, "cpu_s": round(cpu, 1), "grouped_decisions": grouped[0]}


def ratios(cell: dict, full: dict) -> tuple[float, float, float]:
    """(TTFT mean ratio, TTFT p99 ratio, token hit difference in points) of ``cell`` to the
    full pass ``full``."""
    return (cell["ttft_mean_s"] / full["ttft_mean_s"], cell["ttft_p99_s"] / full["ttft_p99_s"],
            100 * (cell["token_hit_ratio"] - full["token_hit_ratio"]))


def summary(results: dict, window: int, names=None) -> tuple[float, float, float]:
    """Over the tuning workloads in ``results`` (``names``: those of one set, default
    ``TUNING``): geometric means of the TTFT mean and p99 ratios and the mean token hit
    difference (points) of ``window`` to the full pass."""
    rows = [ratios(results[name][window], results[name][0]) for name in (names or TUNING) if name in results]
    n = len(rows)
    return (math.exp(sum(math.log(r[0]) for r in rows) / n), math.exp(sum(math.log(r[1]) for r in rows) / n),
            sum(r[2] for r in rows) / n)


def passes(mean_ratio: float, p99_ratio: float, hit_diff_pts: float) -> bool:
    """The pre-registered rule (round 2 of the module docstring)."""
    return mean_ratio <= TTFT_TOLERANCE and p99_ratio <= TTFT_TOLERANCE and hit_diff_pts >= -HIT_TOLERANCE_PTS


def choose_default(results: dict, windows: list[int], names=None) -> int:
    """The smallest window passing over the tuning workloads (``names``), or 0 (off)."""
    for w in sorted(x for x in windows if x):
        if passes(*summary(results, w, names)):
            return w
    return 0


def markdown(report: dict) -> str:
    lines = ["# cache_aware's candidate window at fleet scale", "",
             f"`{report['command']}` at {report['commit']} (simulated, unicache eviction). Window 0: every replica "
             "weighed; W: the replicas that could hit the prompt plus W others, a window moving with each request.", "",
             "| workload | set | window | token hit % | load imbalance | TTFT mean / p90 / p99 s | "
             "TTFT mean / p99 vs window 0 | CPU s | decisions with a grouped prefix |", "|---|---|---|---|---|---|---|---|---|"]
    for name, by_window in report["results"].items():
        full = by_window.get("0")
        for w, r in by_window.items():
            vs = (f"{r['ttft_mean_s'] / full['ttft_mean_s']:.3f}x / {r['ttft_p99_s'] / full['ttft_p99_s']:.3f}x"
                  if full else "-")
            lines.append(f"| {name} | {'report' if name in REPORT else 'tuning'} | {w} | {100 * r['token_hit_ratio']:.2f} | "
                         f"{r['load_imbalance']:.2f} | {r['ttft_mean_s']:.3f} / {r['ttft_p90_s']:.3f} / "
                         f"{r['ttft_p99_s']:.3f} | {vs} | {r['cpu_s']} | {r.get('grouped_decisions', '-')} |")
    if "chosen_window" in report:
        lines += ["", "Over the tuning workloads (geometric mean of the TTFT ratios to window 0, mean token hit "
                  "difference):", "", "| window | TTFT mean | TTFT p99 | token hit, points |", "|---|---|---|---|"]
        for w, (m, p, h) in report["tuning_summary"].items():
            lines.append(f"| {w} | {m:.3f}x | {p:.3f}x | {h:+.2f} |")
        lines += ["", f"Rule (module docstring) over these tuning workloads: window **{report['chosen_window']}** "
                  "(0: off; with windows 0 and 32 only, 32 means it passes)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--windows", default="0,32,64,128")
    ap.add_argument("--workloads", default="tuning,report", help="comma list of: tuning, shared, report")
    ap.add_argument("--out", type=Path, default=RESULTS / "candidate_window")
    args = ap.parse_args()
    windows = [int(x) for x in args.windows.split(",")]
    if 0 not in windows:
        sys.exit("--windows must include 0 (the full pass every other window is compared with)")
    sets = args.workloads.split(",")
    workloads = {**(TUNING if "tuning" in sets else {}), **(SHARED if "shared" in sets else {}),
                 **(REPORT if "report" in sets else {})}
    cells = [(name, spec, w) for name, spec in workloads.items() for w in windows]
    results: dict[str, dict[int, dict]] = {name: {} for name in workloads}
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_cell, *cell) for cell in cells]
        for f in tqdm(as_completed(futures), total=len(futures), desc="replays", file=sys.stderr):
            name, w, r = f.result()
            results[name][w] = r
            tqdm.write(f"{name} window {w}: {r}", file=sys.stderr)
    report = {"command": "python -m bench.studies.candidate_window " + " ".join(sys.argv[1:]),
              "commit": git_commit(Path(__file__).resolve().parents[2]), "cpus": os.cpu_count(),
              "results": {name: {str(w): by[w] for w in sorted(by)} for name, by in results.items()}}
    for names in (TUNING, SHARED):
        if any(name in names for name in workloads):
            report["tuning_summary"] = {str(w): summary(results, w, names) for w in windows if w}
            report["chosen_window"] = choose_default(results, windows, names)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
