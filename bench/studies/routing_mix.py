"""Routing policies on the project's own mix generator at its defaults (issue 4's study).

Superseded as the routing report by ``bench.routing_report`` (the workload suite, goodput
and TTFT per family); kept because the README's gap-closed figures on the default mix
come from it (its results were written as ``routing_report.*`` before the move).

Replays (1) the Mooncake conversation trace (block size 512, classes inferred) and (2) a
generated labelled mix (``unicache gen-workload``, block size 16) through ``unicache.sim``
with 4 and 8 replicas of ``--capacity-frac`` (default 1%) of each trace's unique blocks
*each*, the same ``run_grid`` that ``unicache sim --replicas N --router ... --pooled``
runs:

    * every routing policy with ``unicache`` eviction, plus ``pooled`` unicache;
    * ``sglang`` routing with ``lru`` eviction (today's production default);
    * ``pooled`` ``opt``: one replica with all the capacity and Belady eviction (the limit).

and, at 4 replicas on the mix, an ablation of ``cache_aware`` (each term switched off).
Checks the issue's targets on the mix at 4 replicas (and reports them on Mooncake):

    * gap closed = (cache_aware+unicache - sglang+lru) / (pooled opt - sglang+lru) >= 0.5
      (token hit ratio);
    * cache_aware load imbalance (max / mean prefill tokens computed per replica) <= 1.2;
    * cache_aware TTFT mean and p99 below sglang+lru and sglang+unicache.

Writes ``routing_mix.json`` and ``routing_mix.md`` to ``--out-dir``.

Run (from the repository root):
    .venv/bin/python -m bench.studies.routing_mix [--mix-seeds 0,1,2] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.router.routing.registry import routing_policy_names
from unicache.sim.prepare import PreparedTrace, prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs, run_grid
from unicache.sim.workload import WorkloadConfig, generate
from unicache.trace import read_trace, write_trace
from bench.paths import REPO, RESULTS, mooncake_trace
from bench.report_files import git_commit, save_figure, write_report

OURS = "cache_aware"
ABLATION = {
    "cache_aware (all terms)": {},
    "- churn term": {"churn_weight": 0.0},
    "- session footprint": {"footprint_weight": 0.0},
    "- eviction pressure": {"evict_weight": 0.0},
    "- in-flight prefixes": {"track_inflight": False},
    "- template home": {"template_trust": 0.0},
    "template home keyed on its last block": {"template_key_blocks": 0},
    "- request cost in load": {"request_cost_tokens": 0.0},
    "- TTFT admission": {},
}


class NoAdmission(CacheAwarePolicy):
    """``cache_aware`` with every replica admissible (the ablation of TTFT admission; built
    through ``ReplayConfig.router_factory``, never registered)."""

    def _admissible(self, replicas, n_tokens, block_size, matches):
        return list(replicas)


FACTORIES = {"- TTFT admission": NoAdmission}


def _label(r: dict) -> str:
    return f"{r.get('router', '-')}+{r['policy']}"


def _slim(r: dict) -> dict:
    keep = ("router", "policy", "replicas", "pooled", "capacity_blocks", "token_hit_ratio", "block_hit_ratio",
            "load_imbalance", "ttft_mean_s", "ttft_p99_s", "per_task", "rejected", "evictions", "elapsed_s")
    return {k: r[k] for k in keep if k in r}


def run_ablation(trace: PreparedTrace, base: ReplayConfig) -> list[dict]:
    rows = []
    for name, kwargs in ABLATION.items():
        rec = _slim(Replay(trace, replace(base, policy="unicache", router=OURS, pooled=False, router_kwargs=kwargs,
                                                 router_factory=FACTORIES.get(name))).run())
        rec["variant"], rec["kwargs"] = name, kwargs
        rows.append(rec)
        print(f"    ablation {name:28s} tok hit {rec['token_hit_ratio']:.4f}", file=sys.stderr)
    return rows


def measure(name: str, path: Path, block_size: int, replicas: list[int], frac: float, ablate: bool) -> dict:
    t0 = time.perf_counter()
    trace = prepare(read_trace(path), block_size)
    cap = capacities_from_fracs([frac], trace.unique_blocks)[0]
    print(f"[{name}] {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, {cap} blocks per replica "
          f"(prepared in {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    out = {"name": name, "trace": str(path), "block_size": block_size, "requests": len(trace.requests),
           "unique_blocks": trace.unique_blocks, "capacity_frac": frac, "capacity_blocks": cap, "by_replicas": {}}
    show = lambda r: print(f"  R={r.get('replicas')} {_label(r):24s} tok hit {r['token_hit_ratio']:.4f} "  # noqa: E731
                           f"imb {r.get('load_imbalance', 1.0):.3f} ttft {r['ttft_mean_s']:.3f}/{r['ttft_p99_s']:.3f}",
                           file=sys.stderr)
    for n in replicas:
        base = ReplayConfig("unicache", cap, replicas=n)
        res = run_grid(trace, ["unicache"], [cap], base, routers=routing_policy_names(), pooled=True, on_result=show)
        res += run_grid(trace, ["lru"], [cap], base, routers=["sglang"], on_result=show)
        res += run_grid(trace, ["opt"], [cap], base, routers=(), pooled=True, on_result=show)
        entry = {"results": [_slim(r) for r in res]}
        if ablate and n == replicas[0]:
            entry["ablation"] = run_ablation(trace, base)
        entry["checks"] = check_targets(entry["results"])
        out["by_replicas"][str(n)] = entry
    return out


def _find(results: list[dict], label: str) -> dict:
    return next(r for r in results if _label(r) == label)


def check_targets(results: list[dict]) -> dict:
    ours = _find(results, f"{OURS}+unicache")
    sg_lru, sg_uc = _find(results, "sglang+lru"), _find(results, "sglang+unicache")
    opt = _find(results, "pooled+opt")
    gap = opt["token_hit_ratio"] - sg_lru["token_hit_ratio"]
    closed = (ours["token_hit_ratio"] - sg_lru["token_hit_ratio"]) / gap if gap > 0 else float("nan")
    return {
        "gap_closed": {"value": closed, "ok": closed >= 0.5},
        "load_imbalance": {"value": ours["load_imbalance"], "ok": ours["load_imbalance"] <= 1.2},
        "ttft_mean_below_sglang": {"value": ours["ttft_mean_s"],
                                   "ok": ours["ttft_mean_s"] < min(sg_lru["ttft_mean_s"], sg_uc["ttft_mean_s"])},
        "ttft_p99_below_sglang": {"value": ours["ttft_p99_s"],
                                  "ok": ours["ttft_p99_s"] < min(sg_lru["ttft_p99_s"], sg_uc["ttft_p99_s"])},
    }


def markdown(report: dict) -> str:
    lines = [f"# Routing report\n\nProduced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs) "
             f"at commit {report.get('commit', 'unknown')}.\n",
             "Token hit ratio, load imbalance (max / mean prefill tokens computed per replica) and TTFT "
             "from the simulator; capacity is per replica (pooled: one replica with all of it).\n"]
    for run in report["runs"].values():
        lines.append(f"## {run['name']}: {Path(run['trace']).name}, block size {run['block_size']}\n")
        lines.append(f"{run['requests']} requests, {run['unique_blocks']} unique blocks; "
                     f"{run['capacity_blocks']} blocks per replica ({run['capacity_frac']:.0%}).\n")
        for n, entry in run["by_replicas"].items():
            lines.append(f"### {n} replicas\n")
            lines.append("| router + eviction | token hit % | load imbalance | TTFT mean s | TTFT p99 s |")
            lines.append("|---|---|---|---|---|")
            for r in entry["results"]:
                lines.append(f"| {_label(r)} | {100 * r['token_hit_ratio']:.2f} | {r.get('load_imbalance', 1.0):.3f} "
                             f"| {r['ttft_mean_s']:.4f} | {r['ttft_p99_s']:.4f} |")
            c = entry["checks"]
            lines.append("\nTargets (cache_aware+unicache): " + "; ".join(
                f"{k} {v['value']:.3f} {'met' if v['ok'] else 'NOT met'}" for k, v in c.items()) + ".\n")
            if "ablation" in entry:
                lines.append("Ablation of cache_aware (unicache eviction):\n")
                lines.append("| variant | token hit % | load imbalance | TTFT mean s | TTFT p99 s |")
                lines.append("|---|---|---|---|---|")
                for r in entry["ablation"]:
                    lines.append(f"| {r['variant']} | {100 * r['token_hit_ratio']:.2f} | {r['load_imbalance']:.3f} "
                                 f"| {r['ttft_mean_s']:.4f} | {r['ttft_p99_s']:.4f} |")
                lines.append("")
    if len(report.get("mix_seed_summary", {})) > 0:
        lines.append("## Generated mix, mean over seeds\n")
        lines.append("| replicas | router + eviction | token hit % | max load imbalance | TTFT mean s | TTFT p99 s |")
        lines.append("|---|---|---|---|---|---|")
        for n, rows in report["mix_seed_summary"].items():
            for label, v in rows.items():
                lines.append(f"| {n} | {label} | {100 * v['token_hit_ratio']:.2f} | {v['load_imbalance_max']:.3f} "
                             f"| {v['ttft_mean_s']:.4f} | {v['ttft_p99_s']:.4f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def seed_summary(runs: dict[str, dict]) -> dict:
    mixes = [r for k, r in runs.items() if k.startswith("mix")]
    if len(mixes) < 2:
        return {}
    out: dict[str, dict] = {}
    for n in mixes[0]["by_replicas"]:
        rows: dict[str, list[dict]] = {}
        for m in mixes:
            for r in m["by_replicas"][n]["results"]:
                rows.setdefault(_label(r), []).append(r)
        out[n] = {label: {"token_hit_ratio": statistics.mean(r["token_hit_ratio"] for r in rs),
                          "load_imbalance_max": max(r.get("load_imbalance", 1.0) for r in rs),
                          "ttft_mean_s": statistics.mean(r["ttft_mean_s"] for r in rs),
                          "ttft_p99_s": statistics.mean(r["ttft_p99_s"] for r in rs)} for label, rs in rows.items()}
    return out


def plot(report: dict, path: Path) -> None:
    """Token hit ratio per router + eviction, grouped by replica count: the generated mix
    (mean over seeds) and the Mooncake trace side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if report.get("mix_seed_summary"):
        panels.append(("generated mix (mean over seeds)",
                       {n: {k: v["token_hit_ratio"] for k, v in rows.items()} for n, rows in report["mix_seed_summary"].items()}))
    if "mooncake" in report["runs"]:
        panels.append(("Mooncake trace", {n: {_label(r): r["token_hit_ratio"] for r in d["results"]}
                                           for n, d in report["runs"]["mooncake"]["by_replicas"].items()}))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (title, by_n) in zip(axes[0], panels):
        labels = list(next(iter(by_n.values())))
        width = 0.8 / len(by_n)
        for i, (n, vals) in enumerate(sorted(by_n.items(), key=lambda kv: int(kv[0]))):
            ax.barh([y + i * width for y in range(len(labels))], [100 * vals[lab] for lab in labels], width,
                    label=f"{n} replicas")
        ax.set_yticks([y + width * (len(by_n) - 1) / 2 for y in range(len(labels))], labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("token hit ratio (%)")
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(mooncake_trace()), help="Mooncake trace (default: shared/traces at or above the checkout)")
    ap.add_argument("--trace-block-size", type=int, default=512)
    ap.add_argument("--mix-seeds", default="0", help="comma list of gen-workload seeds (default 0)")
    ap.add_argument("--mix-duration", type=float, default=1200.0)
    ap.add_argument("--mix-block-size", type=int, default=16)
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--capacity-frac", type=float, default=0.01, help="per replica, of unique blocks (default 0.01)")
    ap.add_argument("--skip", default="", help="comma list of runs to skip: mooncake, mix")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--replot", action="store_true", help="only redraw routing_mix.png from routing_mix.json")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads((Path(args.out_dir) / "routing_mix.json").read_text()), Path(args.out_dir) / "routing_mix.png")
        return 0
    replicas = [int(x) for x in args.replicas.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict] = {}
    if "mooncake" not in skip:
        runs["mooncake"] = measure("mooncake", Path(args.trace), args.trace_block_size, replicas, args.capacity_frac, False)
    if "mix" not in skip:
        for i, seed in enumerate(int(s) for s in args.mix_seeds.split(",")):
            mix_path = out_dir / f"routing_mix_seed{seed}.jsonl"
            write_trace(mix_path, generate(WorkloadConfig(seed=seed, duration=args.mix_duration,
                                                          block_size=args.mix_block_size)))
            try:
                runs[f"mix-seed{seed}"] = measure(f"mix-seed{seed}", mix_path, args.mix_block_size, replicas,
                                                  args.capacity_frac, ablate=i == 0)
            finally:
                mix_path.unlink()  # reproducible from the seed
    report = {
        "command": "python -m bench.studies.routing_mix " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "python": platform.python_version(),
        "commit": git_commit(REPO),
        "runs": runs, "mix_seed_summary": seed_summary(runs),
    }
    write_report(out_dir, "routing_mix", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
