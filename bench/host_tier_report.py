"""The host-memory KV tier measured by trace replay: GPU hits, host hits, TTFT.

Replays (1) the Mooncake conversation trace without its first quarter (block size 512,
classes from the classifier; slices 1-3 of 4 in time: slice 0 is the tuning slice on which
the host tier's unicache rule was chosen, the host_tier_drops study, docs/studies.md, so it is not
reported here) and (2) a generated labelled mix (block size 16, seed 0; the rule was
chosen on seeds 100 and up) through ``unicache.sim`` with the GPU
pool at 5% and 10% of each trace's unique blocks and a host tier of 0, 4 and 10 x the GPU
pool, for unicache on both tiers against lru on both tiers; once on one replica and once
on 4 replicas routed by ``cache_aware`` (each replica a quarter of the pool, so the fleet
holds what the one replica does). Promotions cost their KV bytes over the host-to-device
link (``TimingModel``: 128 KiB per token, 25 GB/s) in the promoted request's TTFT.

For scale, each (trace, replicas) also runs lru with room for every unique block and no
host tier (``unbounded``): only compulsory misses, the best any cache can do; its TTFT
over the 0 x row's is the lowest ratio a host tier could reach.

Targets (issue 14), checked per (trace, GPU size, replicas):
    * with a host tier of 4 x GPU, mean TTFT <= 0.6 x the same configuration without one
      (each policy);
    * unicache on both tiers >= lru on both tiers in block hit ratio (GPU + host), at
      every host size.

Run (from the repository root):
    nice -n 10 .venv/bin/python -m bench.host_tier_report [--trace PATH] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from unicache.sim.prepare import prepare
from unicache.sim.replay import ReplayConfig
from unicache.sim.runner import run_grid
from unicache.sim.suite import mooncake_window
from unicache.sim.trace import read_trace, write_trace
from unicache.sim.workload import WorkloadConfig, generate
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import git_commit, save_figure, write_report

POLICIES = ["lru", "unicache"]  # each on both tiers
GPU_FRACS = [0.05, 0.10]
HOST_MULTIPLES = [0, 4, 10]
REPLICAS = [1, 4]
TTFT_TARGET = 0.6


MOONCAKE_SLICES = 4  # slice 0 tunes (the host_tier_drops study, docs/studies.md); 1-3 are reported
MOONCAKE_TUNING_SLICES = 1


def measure(name: str, path: Path, block_size: int, replicas: list[int], progress: bool,
            held_out: bool = False) -> dict:
    requests = read_trace(path)
    if held_out:
        requests = mooncake_window(requests, MOONCAKE_TUNING_SLICES, MOONCAKE_SLICES, MOONCAKE_SLICES)
    trace = prepare(requests, block_size)
    print(f"[{name}] {len(trace.requests)} requests, {trace.unique_blocks} unique blocks", file=sys.stderr)
    results = []
    for n in replicas:
        for frac in GPU_FRACS:
            gpu = int(frac * trace.unique_blocks) // n
            hosts = [m * gpu for m in HOST_MULTIPLES]
            for policy in POLICIES:
                base = ReplayConfig(policy, gpu, replicas=n, router="cache_aware" if n > 1 else None,
                                    host_policy=policy)
                t0 = time.perf_counter()
                recs = run_grid(trace, [policy], [gpu], base, routers=[base.router], host_capacities=hosts,
                                progress=progress)
                for rec, m in zip(recs, HOST_MULTIPLES):
                    rec.update(gpu_frac=frac, host_multiple=m, replicas=n)
                    print(f"  {n}x {policy:<9} gpu {frac:.2f} host {m:>2}x: hit {rec['block_hit_ratio']:.4f} "
                          f"(host {rec['host_hit_ratio']:.4f}) ttft {rec['ttft_mean_s']:.3f}", file=sys.stderr)
                print(f"    {time.perf_counter() - t0:.1f}s", file=sys.stderr)
                results += recs
        cap = -(-trace.unique_blocks // n)
        rec = run_grid(trace, ["lru"], [cap], ReplayConfig("lru", cap, replicas=n,
                                                           router="cache_aware" if n > 1 else None),
                       routers=["cache_aware" if n > 1 else None])[0]
        rec.update(gpu_frac=None, host_multiple=0, replicas=n, unbounded=True)
        print(f"  {n}x unbounded: hit {rec['block_hit_ratio']:.4f} ttft {rec['ttft_mean_s']:.3f}", file=sys.stderr)
        results.append(rec)
    return {"name": name, "trace": str(path), "held_out": held_out, "block_size": block_size, "requests": len(trace.requests),
            "unique_blocks": trace.unique_blocks, "block_accesses": trace.block_accesses, "results": results}


def _unbounded(results, replicas):
    return next(r for r in results if r.get("unbounded") and r["replicas"] == replicas)


def _get(results, policy, frac, multiple, replicas):
    for r in results:
        if r.get("unbounded"):
            continue
        if (r["policy"], r["gpu_frac"], r["host_multiple"], r["replicas"]) == (policy, frac, multiple, replicas):
            return r
    raise KeyError((policy, frac, multiple, replicas))


def check_targets(runs: dict[str, dict]) -> list[dict]:
    checks = []
    for key, run in runs.items():
        res = run["results"]
        for n in sorted({r["replicas"] for r in res}):
            for frac in GPU_FRACS:
                where = f"{key}, {n} replica{'s' if n > 1 else ''}, GPU {frac:.0%}"
                for policy in POLICIES:
                    base = _get(res, policy, frac, 0, n)["ttft_mean_s"]
                    ratio = _get(res, policy, frac, 4, n)["ttft_mean_s"] / base
                    checks.append({"target": f"{policy}: mean TTFT with host 4x / without <= {TTFT_TARGET}",
                                   "where": where, "value": ratio, "ok": ratio <= TTFT_TARGET,
                                   "bound": _unbounded(res, n)["ttft_mean_s"] / base})
                for m in HOST_MULTIPLES[1:]:
                    uc, lru = _get(res, "unicache", frac, m, n), _get(res, "lru", frac, m, n)
                    diff = uc["block_hit_ratio"] - lru["block_hit_ratio"]
                    checks.append({"target": f"unicache - lru block hit ratio, host {m}x >= 0", "where": where,
                                   "value": diff, "ok": diff >= 0})
    return checks


def markdown(report: dict) -> str:
    lines = [f"# Host KV tier (commit {report['commit']})", "",
             "Hit ratios are of all prompt block accesses; total = GPU + host (promoted). TTFT in seconds; "
             "a promotion's copy (128 KiB/token at 25 GB/s) is in its request's TTFT.", "",
             f"Mooncake: slices {MOONCAKE_TUNING_SLICES}-{MOONCAKE_SLICES - 1} of {MOONCAKE_SLICES} in time "
             "(the last three quarters of the trace); slice 0 is the tuning slice the host tier's unicache rule "
             "was chosen on (the `host_tier_drops` study, docs/studies.md), with mix seeds 100-104; the mix here is "
             "seed 0.", ""]
    for key, run in report["runs"].items():
        lines += [f"## {key} ({run['requests']} requests, {run['unique_blocks']} unique blocks, "
                  f"block size {run['block_size']})", "",
                  "| replicas | GPU | host | policy | GPU hit % | host hit % | total % | TTFT mean | TTFT p99 | "
                  "mean vs host 0 |", "|---|---|---|---|---|---|---|---|---|---|"]
        res = run["results"]
        for r in res:
            if r.get("unbounded"):
                lines.append(f"| {r['replicas']} | unbounded ({r['capacity_blocks']}) | - | lru | "
                             f"{100 * r['gpu_hit_ratio']:.2f} | - | {100 * r['block_hit_ratio']:.2f} | "
                             f"{r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} | - |")
                continue
            base = _get(res, r["policy"], r["gpu_frac"], 0, r["replicas"])["ttft_mean_s"]
            lines.append(f"| {r['replicas']} | {r['gpu_frac']:.0%} ({r['capacity_blocks']}) | {r['host_multiple']}x "
                         f"({r['host_capacity_blocks']}) | {r['policy']} | {100 * r['gpu_hit_ratio']:.2f} | "
                         f"{100 * r['host_hit_ratio']:.2f} | {100 * r['block_hit_ratio']:.2f} | "
                         f"{r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['ttft_mean_s'] / base:.2f} |")
        lines.append("")
    lines += ["## Targets", "", "For the TTFT target, bound = unbounded cache's mean TTFT / the 0x row's: no host "
              "tier can go below it.", "",
              "| target | where | value | bound | met |", "|---|---|---|---|---|"]
    for c in report["checks"]:
        bound = f"{c['bound']:.3f}" if "bound" in c else "-"
        lines.append(f"| {c['target']} | {c['where']} | {c['value']:+.4f} | {bound} | {'yes' if c['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    cols = [(key, frac) for key in runs for frac in GPU_FRACS]
    fig, axes = plt.subplots(2, len(cols), figsize=(4.2 * len(cols), 6.4), squeeze=False)
    for j, (key, frac) in enumerate(cols):
        res = runs[key]["results"]
        for n in sorted({r["replicas"] for r in res}):
            for policy, color in (("lru", "tab:blue"), ("unicache", "tab:red")):
                rows = [_get(res, policy, frac, m, n) for m in HOST_MULTIPLES]
                style = "-" if n == 1 else "--"
                label = f"{policy} both tiers, {n} replica{'s' if n > 1 else ''}"
                axes[0][j].plot(HOST_MULTIPLES, [100 * r["block_hit_ratio"] for r in rows], style, color=color,
                                marker="o", label=label)
                axes[1][j].plot(HOST_MULTIPLES, [r["ttft_mean_s"] for r in rows], style, color=color, marker="o",
                                label=label)
            ub = _unbounded(res, n)
            style = "-" if n == 1 else "--"
            axes[0][j].axhline(100 * ub["block_hit_ratio"], color="gray", linestyle=style, linewidth=0.8,
                               label=f"unbounded cache, {n} replica{'s' if n > 1 else ''}")
            axes[1][j].axhline(ub["ttft_mean_s"], color="gray", linestyle=style, linewidth=0.8)
        axes[0][j].set_title(f"{key}, GPU {frac:.0%} of unique blocks")
        axes[0][j].set_ylabel("block hit % (GPU + host)")
        axes[1][j].set_ylabel("mean TTFT (s)")
        axes[1][j].set_xlabel("host tier (x GPU pool)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(HOST_MULTIPLES)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake conversation trace (default: shared/traces)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--mix-seed", type=int, default=0)
    ap.add_argument("--mix-duration", type=float, default=1200.0)
    ap.add_argument("--replicas", default="1,4", help="comma list of fleet sizes (default 1,4)")
    ap.add_argument("--skip", default="", help="comma list of runs to skip: mooncake, mix")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    replicas = [int(x) for x in args.replicas.split(",")]
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    if "mooncake" not in skip:
        runs["mooncake"] = measure("mooncake", args.trace or mooncake_trace(), 512, replicas, args.progress,
                                   held_out=True)
    if "mix" not in skip:
        mix_path = out_dir / f"host_mix_seed{args.mix_seed}.jsonl"
        write_trace(mix_path, generate(WorkloadConfig(seed=args.mix_seed, duration=args.mix_duration, block_size=16)))
        try:
            runs["mix"] = measure("mix", mix_path, 16, replicas, args.progress)
        finally:
            mix_path.unlink()  # reproducible from the seed
    report = {"commit": git_commit(Path(__file__).resolve().parents[1]), "policies": POLICIES,
              "gpu_fracs": GPU_FRACS, "host_multiples": HOST_MULTIPLES, "runs": runs}
    report["checks"] = check_targets(runs)
    write_report(out_dir, "host_tier_report", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
