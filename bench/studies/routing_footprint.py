"""The session footprint term of ``cache_aware``: chosen on some mix seeds, checked on others.

``cache_aware`` charges a replica for the share of its cache that live sessions will read
again soon (``footprint_weight`` x N x F_r / capacity; ``router/routing/cache_aware.py``).
Its weight and window were picked on one set of generated-mix seeds; this script replays
each variant on that set and on a second, held-out set, so the figures show whether the
gain carries over to traces the choice never saw. Routing chaos is large here (a change
that moves one early request reshuffles everything after it), so single seeds swing by
several points: the paired per-seed difference against the term switched off, averaged
over many seeds, is the figure to read.

Every run: ``cache_aware`` routing, ``unicache`` eviction, 4 replicas x 1% of the seed's
unique blocks each (the routing target's setting), the same ``Replay`` as ``unicache sim``.

Writes ``routing_footprint.json``, ``.md`` and ``.png`` to ``--out-dir``.

Run (from the repository root; about 4 minutes on 2 CPUs):
    .venv/bin/python -m bench.studies.routing_footprint [--select-seeds 0-8] [--holdout-seeds 9-17]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay, ReplayConfig
from bench.paths import RESULTS
from bench.mix_traces import prepared_mix
from bench.report_files import save_figure, write_report
from bench.workers import map_in_workers

OFF = "footprint off"
DEFAULT = "default (weight 0.5, window 96)"
VARIANTS: dict[str, dict] = {
    OFF: {"footprint_weight": 0.0},
    DEFAULT: {},
    "weight 0.25": {"footprint_weight": 0.25},
    "weight 1.0": {"footprint_weight": 1.0},
    "window 64": {"footprint_window": 64},
    "window 128": {"footprint_window": 128},
}


def seed_list(text: str) -> list[int]:
    """``"0-8"`` or ``"0,3,5"`` (or a mix) -> seeds."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run_seed(job: tuple[int, int, float]) -> dict:
    """Every variant on one seed: {variant: {token_hit_ratio, load_imbalance, ttft...}}."""
    seed, replicas, frac = job
    t0 = time.perf_counter()
    trace, cap = prepared_mix(seed, capacity_frac=frac)
    out = {}
    for name, kwargs in VARIANTS.items():
        rec = Replay(trace, ReplayConfig("unicache", cap, replicas=replicas, router="cache_aware",
                                         router_kwargs=kwargs)).run()
        out[name] = {k: rec[k] for k in ("token_hit_ratio", "load_imbalance", "ttft_mean_s", "ttft_p99_s", "rejected")}
    print(f"[seed {seed}] {time.perf_counter() - t0:.0f} s: " + ", ".join(
        f"{n} {100 * r['token_hit_ratio']:.2f}" for n, r in out.items()), file=sys.stderr, flush=True)
    return {"seed": seed, "capacity_blocks": cap, "variants": out}


def summarise(runs: list[dict]) -> dict[str, dict]:
    """Per variant: mean token hit %, mean paired difference against OFF, seeds improved."""
    summary = {}
    for name in VARIANTS:
        hits = [100 * r["variants"][name]["token_hit_ratio"] for r in runs]
        diffs = [h - 100 * r["variants"][OFF]["token_hit_ratio"] for h, r in zip(hits, runs)]
        summary[name] = {
            "mean_token_hit_pct": statistics.mean(hits),
            "mean_diff_vs_off_pts": statistics.mean(diffs),
            "stdev_diff_pts": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "seeds_improved": sum(d > 0 for d in diffs),
            "seeds": len(runs),
            "max_load_imbalance": max(r["variants"][name]["load_imbalance"] for r in runs),
            "mean_ttft_s": statistics.mean(r["variants"][name]["ttft_mean_s"] for r in runs),
        }
    return summary


def _span(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def markdown(report: dict) -> str:
    lines = [
        "# cache_aware's session footprint term, selection and held-out seeds",
        "",
        f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs). Generated mix, "
        f"{report['replicas']} replicas x {100 * report['capacity_frac']:g}% of unique blocks each, "
        "cache_aware routing, unicache eviction. Differences are paired per seed against the term switched off.",
        "",
    ]
    for part in ("select", "holdout"):
        seeds = report["seeds"][part]
        lines += [f"## {'Selection' if part == 'select' else 'Held-out'} seeds {_span(seeds)}", "",
                  "| variant | token hit % | diff vs off (pts) | sd of diff | seeds improved | max imbalance | TTFT mean s |",
                  "|---|---|---|---|---|---|---|"]
        for name, s in report["summary"][part].items():
            lines.append(f"| {name} | {s['mean_token_hit_pct']:.2f} | {s['mean_diff_vs_off_pts']:+.2f} | "
                         f"{s['stdev_diff_pts']:.2f} | {s['seeds_improved']}/{s['seeds']} | "
                         f"{s['max_load_imbalance']:.3f} | {s['mean_ttft_s']:.4f} |")
        lines.append("")
    lines += ["## Per seed, token hit %", "", "| seed | " + " | ".join(VARIANTS) + " |",
              "|---|" + "---|" * len(VARIANTS)]
    for r in report["runs"]:
        lines.append(f"| {r['seed']} | " + " | ".join(
            f"{100 * r['variants'][n]['token_hit_ratio']:.2f}" for n in VARIANTS) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = list(VARIANTS)
    width = 0.38
    for i, part in enumerate(("select", "holdout")):
        s = report["summary"][part]
        ax.bar([x + i * width for x in range(len(names))], [s[n]["mean_diff_vs_off_pts"] for n in names], width,
               yerr=[s[n]["stdev_diff_pts"] / max(1, s[n]["seeds"]) ** 0.5 for n in names], capsize=3,
               label=f"{part} seeds {_span(report['seeds'][part])}")
    ax.axhline(0, color="grey", lw=1)
    ax.set_xticks([x + width / 2 for x in range(len(names))], names, rotation=15, fontsize=8)
    ax.set_ylabel("token hit points vs footprint off\n(mean of paired diffs, ± s.e.)")
    ax.set_title("cache_aware session footprint term, generated mix, 4 replicas x 1%")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--select-seeds", default="0-8", help="seeds the defaults were chosen on (default 0-8)")
    ap.add_argument("--holdout-seeds", default="9-17", help="seeds the choice never saw (default 9-17)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--capacity-frac", type=float, default=0.01, help="per replica, of unique blocks")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes (one seed each)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    seeds = {"select": seed_list(args.select_seeds), "holdout": seed_list(args.holdout_seeds)}
    if not seeds["select"] or not seeds["holdout"]:
        ap.error("both seed sets must be non-empty")
    defaults = CacheAwarePolicy()
    if (defaults.footprint_weight, defaults.footprint_window) != (0.5, 96):
        ap.error("the DEFAULT label no longer names cache_aware's defaults: update VARIANTS")
    jobs = [(s, args.replicas, args.capacity_frac) for s in seeds["select"] + seeds["holdout"]]
    runs = map_in_workers(run_seed, jobs, args.workers)
    by_seed = {r["seed"]: r for r in runs}
    report = {
        "command": "python -m bench.studies.routing_footprint " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "python": platform.python_version(),
        "replicas": args.replicas, "capacity_frac": args.capacity_frac, "seeds": seeds, "variants": VARIANTS,
        "summary": {part: summarise([by_seed[s] for s in ss]) for part, ss in seeds.items()},
        "runs": runs,
    }
    out_dir = Path(args.out_dir)
    write_report(out_dir, "routing_footprint", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
