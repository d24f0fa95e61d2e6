"""Ablation of the unicache eviction policy: each ingredient off (or swapped) in turn.

The variants are ``bench/unicache_variants.py``'s ``AblationUniCache`` (the production
policy has no switches).

Runs ``unicache sim``'s replay (``unicache.sim``) on the Mooncake trace (block size 512,
classes inferred) and on a generated mix (block size 16; labelled, and with labels hidden
so that the classifier infers the classes) at 5% and 10% of the unique blocks, for lru, opt and every unicache variant. Writes JSON and a markdown table;
also reports each variant's gap closure (unicache - lru) / (opt - lru).

    .venv/bin/python -m bench.unicache_ablation --out bench/results/unicache_ablation
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from unicache.sim.prepare import future_accesses, prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.workload import WorkloadConfig, generate
from unicache.trace import read_trace, write_trace
from bench.paths import RESULTS, mooncake_trace
from bench.unicache_variants import AblationUniCache

# name -> AblationUniCache kwargs (the full policy is {}).
VARIANTS: dict[str, dict] = {
    "unicache (full)": {},
    "- session queues": {"session_queues": False},
    "- agent/chat split": {"split_agent": False},
    "- structural queue": {"structural": False},
    "- turn-depth lanes": {"turn_lanes": False},
    "- hit-count lanes": {"freq_lanes": False},
    "- last-prompt-block lane": {"tail_lane": False},
    "- novel-prefix lane": {"novel_lane": False},
    "novel lane weighed (not emptied first)": {"novel_first": False},
    "+ ghost re-cache counts as a hit": {"ghost_uses": True},
    "- online gap fit (priors)": {"online_fit": False},
    "gaps arrival to arrival (not from release)": {"gap_from_release": False},
    "- global weights (alpha=1)": {"weighting": "none"},
    "paper weights (efficiency, T=0.2)": {"weighting": "efficiency"},
    "- horizon (score p*S(age))": {"horizon_scoring": False},
    "- structural rate (by last use)": {"structural_rate": False},
    "+ strict evict-first": {"strict_evict_first": True},
}


def run_trace(name: str, trace_path: str, block_size: int, fracs: list[float], ignore_labels: bool = False) -> list[dict]:
    prepared = prepare(read_trace(trace_path), block_size, ignore_labels=ignore_labels)
    future = future_accesses(prepared)
    rows = []
    for frac in fracs:
        cap = int(frac * prepared.unique_blocks)
        runs = [("lru", "lru", {}, None), ("opt", "opt", {}, None)]
        runs += [(v, "unicache", kw, AblationUniCache) for v, kw in VARIANTS.items()]
        base = {}
        for label, policy, kw, factory in runs:
            cfg = ReplayConfig(policy=policy, capacity_blocks=cap, policy_kwargs=kw, policy_factory=factory)
            rec = Replay(prepared, cfg, future=future).run()
            hr = rec["block_hit_ratio"]
            base.setdefault(label, hr)
            closure = None
            if label not in ("lru", "opt") and base["opt"] > base["lru"]:
                closure = (hr - base["lru"]) / (base["opt"] - base["lru"])
            rows.append({
                "trace": name, "capacity_frac": frac, "capacity_blocks": cap, "variant": label,
                "block_hit_ratio": hr, "gap_closure": closure, "accesses_per_s": rec["accesses_per_s"],
            })
            print(f"{name:9} {frac:5.2f} {label:36} hit={hr:.4f}"
                  + (f" closure={closure:+.3f}" if closure is not None else ""), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    order = {"mooncake": 0, "mix": 1, "mix-inferred": 2}
    cols = sorted({(r["trace"], r["capacity_frac"]) for r in rows}, key=lambda c: (order.get(c[0], 3), c[1]))
    head = "| variant | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["trace"], r["capacity_frac"], r["variant"]): r for r in rows}
    for v in variants:
        parts = []
        for t, f in cols:
            r = cell[(t, f, v)]
            c = r["gap_closure"]
            parts.append(f"{r['block_hit_ratio']:.4f}" + (f" ({c:+.2f})" if c is not None else ""))
        lines.append(f"| {v} | " + " | ".join(parts) + " |")
    lines.append("")
    lines.append("Block hit ratio; in brackets the share of the lru-to-opt gap closed.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "unicache_ablation"), help="output path without extension")
    ap.add_argument("--fracs", default="0.05,0.1")
    ap.add_argument("--mooncake", default=str(mooncake_trace()))
    ap.add_argument("--mix-seed", type=int, default=0)
    ap.add_argument("--mix-duration", type=float, default=1200.0, help="seconds of generated mix (as bench/eviction_report.py)")
    args = ap.parse_args()
    fracs = [float(x) for x in args.fracs.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mix_path = out.with_name(out.name + "_mix.jsonl")
    write_trace(mix_path, generate(WorkloadConfig(seed=args.mix_seed, duration=args.mix_duration)))
    t0 = time.perf_counter()
    rows = (run_trace("mooncake", args.mooncake, 512, fracs) + run_trace("mix", str(mix_path), 16, fracs)
            + run_trace("mix-inferred", str(mix_path), 16, fracs, ignore_labels=True))
    mix_path.unlink()
    meta = {"fracs": fracs, "mix_seed": args.mix_seed, "mix_duration_s": args.mix_duration,
            "elapsed_s": time.perf_counter() - t0}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
