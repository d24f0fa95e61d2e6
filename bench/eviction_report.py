"""Eviction policies compared by trace replay: hit ratio, TTFT and simulator speed.

Replays (1) the Mooncake conversation trace (block size 512, no labels: classes come
from the classifier) and (2) a generated labelled mix (block size 16; also replayed with
labels ignored to score the classifier) through ``unicache.sim`` at 2/5/10/25% of each
trace's unique blocks, with every policy of the registry: the classic baselines (lru,
fifo, lfu with aging, arc, s3fifo, lecar, radix-lru), unicache and opt. Writes a JSON
report and markdown tables (hit ratio; TTFT mean/p99), one PNG per trace (hit ratio
against capacity), and checks the targets:

    * unicache >= lru at every capacity on both traces;
    * unicache >= the best classic baseline at every capacity on every trace (issue 14);
    * (unicache - lru) / (opt - lru) >= 0.5 on the labelled mix at 5% and 10%;
    * the same ratio >= 0.25 on the Mooncake trace (inferred classes) at 5% and 10%;
    * accesses/s >= 200,000 for lru and >= 100,000 for unicache (one core).

Run (from the repository root):
    .venv/bin/python -m bench.eviction_report [--trace PATH] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from unicache.sim.plot import plot_hit_ratio
from unicache.sim.prepare import prepare
from unicache.sim.replay import ReplayConfig
from unicache.sim.runner import capacities_from_fracs, run_grid
from unicache.sim.trace import read_trace, write_trace
from unicache.sim.workload import WorkloadConfig, generate
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import write_report

CLASSIC = ["lru", "fifo", "lfu", "arc", "s3fifo", "lecar", "radix-lru"]
POLICIES = CLASSIC + ["unicache", "opt"]
FRACS = [0.02, 0.05, 0.10, 0.25]
SPEED_TARGETS = {"lru": 200_000, "unicache": 100_000}


def measure(name: str, path: Path, block_size: int, ignore_labels: bool, policies, fracs, progress: bool) -> dict:
    t0 = time.perf_counter()
    trace = prepare(read_trace(path), block_size, ignore_labels=ignore_labels)
    prep_s = time.perf_counter() - t0
    caps = capacities_from_fracs(fracs, trace.unique_blocks)
    print(f"[{name}] {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, "
          f"{trace.block_accesses} accesses (hash+classify {prep_s:.1f}s)", file=sys.stderr)
    results = run_grid(trace, policies, caps, ReplayConfig(policies[0], caps[0]), progress=progress,
                       on_result=lambda r: print(f"  {r['policy']:<10} {r['capacity_blocks']:>7} "
                                                 f"hit {r['block_hit_ratio']:.4f} {r['accesses_per_s']:,.0f}/s",
                                                 file=sys.stderr))
    for r in results:
        r["capacity_frac"] = fracs[caps.index(r["capacity_blocks"])]
    out = {
        "name": name, "trace": str(path), "block_size": block_size, "ignore_labels": ignore_labels,
        "requests": len(trace.requests), "unique_blocks": trace.unique_blocks,
        "block_accesses": trace.block_accesses, "prepare_s": prep_s, "results": results,
    }
    if trace.classifier_accuracy is not None:
        out["classifier_accuracy"] = trace.classifier_accuracy
    return out


def _get(results, policy, frac):
    for r in results:
        if r["policy"] == policy and r["capacity_frac"] == frac:
            return r
    return None


def check_targets(runs: dict[str, dict], fracs) -> list[dict]:
    checks = []
    for key, gap_target in (("mix", 0.5), ("mix-inferred", None), ("mooncake", 0.25)):
        run = runs.get(key)
        if run is None:
            continue
        res = run["results"]
        for frac in fracs:
            lru, uc, opt = (_get(res, p, frac) for p in ("lru", "unicache", "opt"))
            if lru and uc:
                checks.append({"trace": key, "target": f"unicache >= lru at {frac:.0%}",
                               "value": uc["block_hit_ratio"] - lru["block_hit_ratio"],
                               "ok": uc["block_hit_ratio"] >= lru["block_hit_ratio"]})
            classic = [r for p in CLASSIC if (r := _get(res, p, frac))]
            if uc and len(classic) > 1:
                best = max(classic, key=lambda r: r["block_hit_ratio"])
                checks.append({"trace": key, "target": f"unicache >= best classic ({best['policy']}) at {frac:.0%}",
                               "value": uc["block_hit_ratio"] - best["block_hit_ratio"],
                               "ok": uc["block_hit_ratio"] >= best["block_hit_ratio"]})
            if lru and uc and opt and frac in (0.05, 0.10) and gap_target is not None:
                gap = opt["block_hit_ratio"] - lru["block_hit_ratio"]
                ratio = (uc["block_hit_ratio"] - lru["block_hit_ratio"]) / gap if gap > 0 else float("nan")
                checks.append({"trace": key, "target": f"(unicache-lru)/(opt-lru) >= {gap_target} at {frac:.0%}",
                               "value": ratio, "ok": ratio >= gap_target})
    for policy, floor in SPEED_TARGETS.items():
        speeds = [r["accesses_per_s"] for run in runs.values() for r in run["results"] if r["policy"] == policy]
        if speeds:
            checks.append({"trace": "all", "target": f"{policy} accesses/s >= {floor:,} (min over runs)",
                           "value": min(speeds), "ok": min(speeds) >= floor})
    return checks


def markdown(report: dict) -> str:
    lines = [f"# Eviction report\n\nProduced by `{report['command']}` on {report['host']} "
             f"({report['cpus']} CPUs, shared with other jobs: speeds are indicative).\n"]
    for run in report["runs"].values():
        res = run["results"]
        policies = list(dict.fromkeys(r["policy"] for r in res))
        fracs = list(dict.fromkeys(r["capacity_frac"] for r in res))
        label = "labels ignored (classes inferred)" if run["ignore_labels"] else (
            "labelled" if run.get("labelled", True) and "mix" in run["name"] else "classes inferred")
        lines.append(f"## {run['name']}: {Path(run['trace']).name}, block size {run['block_size']}, {label}\n")
        lines.append(f"{run['requests']} requests, {run['unique_blocks']} unique blocks, "
                     f"{run['block_accesses']} block accesses.\n")
        lines.append("Block hit ratio, %; gap closed = (unicache - lru) / (opt - lru); best classic = the "
                     "best of " + ", ".join(p for p in policies if p in CLASSIC) + ".\n")
        lines.append("| capacity | " + " | ".join(policies) + " | best classic | gap closed |")
        lines.append("|---" * (len(policies) + 3) + "|")
        ttft_lines = ["| capacity | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
        for frac in fracs:
            row = [_get(res, p, frac) for p in policies]
            cap = row[0]["capacity_blocks"]
            hit = [f"{100 * r['block_hit_ratio']:.2f}" for r in row]
            lru, uc, opt = (_get(res, p, frac) for p in ("lru", "unicache", "opt"))
            gap = "-"
            if lru and uc and opt and opt["block_hit_ratio"] > lru["block_hit_ratio"]:
                gap = f"{(uc['block_hit_ratio'] - lru['block_hit_ratio']) / (opt['block_hit_ratio'] - lru['block_hit_ratio']):.2f}"
            classic = [r for r in row if r["policy"] in CLASSIC]
            best = max(classic, key=lambda r: r["block_hit_ratio"]) if classic else None
            best_cell = f"{best['policy']} {100 * best['block_hit_ratio']:.2f}" if best else "-"
            lines.append(f"| {frac:.0%} ({cap}) | " + " | ".join(hit) + f" | {best_cell} | {gap} |")
            ttft = [f"{r['ttft_mean_s']:.3f}/{r['ttft_p99_s']:.3f}" for r in row]
            ttft_lines.append(f"| {frac:.0%} ({cap}) | " + " | ".join(ttft) + " |")
        lines.append("\nTime to first token, mean/p99 seconds (simulated prefill time model):\n")
        lines.extend(ttft_lines)
        speeds = {p: sum(v) / len(v) for p in policies if (v := [r["accesses_per_s"] for r in res if r["policy"] == p])}
        base = speeds.get("lru")
        lines.append("\nSimulator speed (block accesses per CPU second, mean over capacities; ratio to lru in "
                     "the same run): " + ", ".join(
                         f"{p} {v:,.0f}" + (f" ({v / base:.2f}x)" if base else "") for p, v in speeds.items()) + ".")
        if "classifier_accuracy" in run:
            acc = run["classifier_accuracy"]
            lines.append("\nClassifier accuracy against the labels: "
                         + ", ".join(f"{k} {v:.3f}" for k, v in acc.items() if k != "labelled_requests") + ".")
        lines.append("")
    lines.append("## Targets\n")
    lines.append("| trace | target | value | met |")
    lines.append("|---|---|---|---|")
    for c in report["checks"]:
        v = c["value"]
        value = f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
        lines.append(f"| {c['trace']} | {c['target']} | {value} | {'yes' if c['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(mooncake_trace()), help="Mooncake trace (default: shared/traces at or above the checkout)")
    ap.add_argument("--trace-block-size", type=int, default=512)
    ap.add_argument("--mix-seed", type=int, default=0)
    ap.add_argument("--mix-duration", type=float, default=1200.0)
    ap.add_argument("--mix-block-size", type=int, default=16)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fracs", default=",".join(str(f) for f in FRACS))
    ap.add_argument("--skip", default="", help="comma list of runs to skip: mooncake, mix, mix-inferred")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    fracs = [float(f) for f in args.fracs.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict] = {}
    if "mooncake" not in skip:
        runs["mooncake"] = measure("mooncake", Path(args.trace), args.trace_block_size, False, policies, fracs, args.progress)
    mix_path = out_dir / f"mix_seed{args.mix_seed}.jsonl"
    if not {"mix", "mix-inferred"} <= skip:
        cfg = WorkloadConfig(seed=args.mix_seed, duration=args.mix_duration, block_size=args.mix_block_size)
        write_trace(mix_path, generate(cfg))
    if "mix" not in skip:
        runs["mix"] = measure("mix", mix_path, args.mix_block_size, False, policies, fracs, args.progress)
    if "mix-inferred" not in skip:
        runs["mix-inferred"] = measure("mix-inferred", mix_path, args.mix_block_size, True, policies, fracs, args.progress)
    if mix_path.exists():
        mix_path.unlink()  # reproducible from the seed; keep the results directory small

    report = {
        "command": "python -m bench.eviction_report " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "runs": runs,
    }
    report["checks"] = check_targets(runs, fracs)
    for name, run in runs.items():
        plot_hit_ratio(run["results"], run["unique_blocks"], str(out_dir / f"eviction_{name}.png"),
                       title=f"{name}: block hit ratio vs capacity (block size {run['block_size']})")
    write_report(out_dir, "eviction_report", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
