"""Eviction on traffic from another generator: unicache against the classic policies on
``bench.foreign_workload`` traces.

The eviction report (``bench.eviction_report``) compares every policy of the registry on
the Mooncake trace and one mix of the project's own generator, whose sources are the
ones UniCache's queues are named after. This study replays traces of the second
generator (power-law chat with regenerations and edits, RAG, agent swarms, drifting
few-shot templates, long documents, bursty arrivals; labels only as a client sends them:
tenant, session id and turn, the rest inferred by the classifier) on one replica at 2, 5,
10 and 25% of each trace's unique blocks, with the same policies and the report's
``measure``, and scores issue 14's target there: unicache >= the best classic policy at
every capacity on every trace. Nothing is tuned here.

``--variant NAME=JSON`` (repeatable) adds an ablation variant of UniCache
(``bench.unicache_variants.AblationUniCache`` keyword arguments, as
``bench.eviction_tuning``'s) beside the policies; run it on seeds no report uses
(``--first-seed 100``).

Writes ``foreign_eviction.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced; about 1 min per trace):
    nice -n 10 .venv/bin/python -m bench.studies.foreign_eviction [--seeds 24] [--duration 1200]
        [--first-seed 100 --seeds 12 --variant 'adaptive={"adaptive_novel_first": true}' --out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.eviction_report import CLASSIC, FRACS, POLICIES, _get, measure
from bench.foreign_workload import BLOCK_SIZE, add_trace_args, foreign_trace_files
from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, produced_by, write_report
from bench.unicache_variants import AblationUniCache
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs
from unicache.trace import read_trace


def variant_results(path: Path, variants: dict[str, dict], fracs) -> list[dict]:
    """Each ablation variant's block hit ratio at each capacity fraction of ``path``'s trace."""
    trace = prepare(read_trace(path), BLOCK_SIZE)
    out = []
    for frac, cap in zip(fracs, capacities_from_fracs(fracs, trace.unique_blocks)):
        for name, kwargs in variants.items():
            rec = Replay(trace, ReplayConfig("unicache", cap, policy_kwargs=kwargs, policy_factory=AblationUniCache)).run()
            out.append({"policy": name, "capacity_frac": frac, "capacity_blocks": cap,
                        "block_hit_ratio": rec["block_hit_ratio"]})
    return out


def compare(run: dict, fracs, variants: tuple[str, ...] = ()) -> list[dict]:
    """Per capacity: lru, the best classic policy, unicache, opt and each variant (block
    hit ratios)."""
    rows = []
    for frac in fracs:
        res = run["results"]
        best = max((r for p in CLASSIC if (r := _get(res, p, frac))), key=lambda r: r["block_hit_ratio"])
        uc, lru, opt = (_get(res, p, frac) for p in ("unicache", "lru", "opt"))
        rows.append({"frac": frac, "capacity_blocks": uc["capacity_blocks"], "lru": lru["block_hit_ratio"],
                     "best_classic": best["policy"], "best_classic_hit": best["block_hit_ratio"],
                     "unicache": uc["block_hit_ratio"], "opt": opt["block_hit_ratio"] if opt else None,
                     "ok": uc["block_hit_ratio"] >= best["block_hit_ratio"],
                     "variants": {v: _get(res, v, frac)["block_hit_ratio"] for v in variants}})
    return rows


def markdown(report: dict) -> str:
    lines = ["# Eviction on another generator's traffic", "",
             produced_by(report), "",
             f"`bench.foreign_workload` traces, {report['duration']:.0f} s each, block size {BLOCK_SIZE}, one replica; "
             "labels as a client sends them (tenant, session id, turn), task and template inferred. Block hit ratio, %.",
             "", "| trace | requests | unique blocks | capacity | lru | best classic | unicache | opt | unicache - best |",
             "|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    for t in report["traces"]:
        for row in t["rows"]:
            met, total = met + row["ok"], total + 1
            opt = f"{100 * row['opt']:.2f}" if row["opt"] is not None else "-"
            lines.append(f"| {t['name']} | {t['requests']} | {t['unique_blocks']} | {row['frac']:.0%} ({row['capacity_blocks']}) "
                         f"| {100 * row['lru']:.2f} | {row['best_classic']} {100 * row['best_classic_hit']:.2f} | "
                         f"{100 * row['unicache']:.2f} | {opt} | "
                         f"{100 * (row['unicache'] - row['best_classic_hit']):+.2f}{'' if row['ok'] else ' **NO**'} |")
    lines += ["", f"unicache >= the best classic policy: **{met} of {total}** (trace, capacity) pairs.", ""]
    rows = [row for t in report["traces"] for row in t["rows"]]
    lines += ["Mean over the pairs, points: " + ", ".join(
        f"{name} {100 * sum(r[key] for r in rows) / len(rows):.3f}" for name, key in (("lru", "lru"), ("best classic", "best_classic_hit"), ("unicache", "unicache"))) + ".", ""]
    if report.get("variants"):
        lines += ["Variants (`AblationUniCache`), on the same pairs:", "",
                  "| variant | settings | mean hit % | minus unicache, points | >= best classic |", "|---|---|---|---|---|"]
        for name, kw in report["variants"].items():
            hits = [r["variants"][name] for r in rows]
            lines.append(f"| {name} | `{json.dumps(kw)}` | {100 * sum(hits) / len(hits):.3f} | "
                         f"{100 * sum(h - r['unicache'] for h, r in zip(hits, rows)) / len(rows):+.3f} | "
                         f"{sum(h >= r['best_classic_hit'] for h, r in zip(hits, rows))} of {len(rows)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, seeds=24)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--variant", action="append", default=[], help="NAME=JSON kwargs of AblationUniCache (repeatable)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    try:
        variants = {v.split("=", 1)[0]: json.loads(v.split("=", 1)[1]) for v in args.variant}
    except (IndexError, ValueError) as e:
        ap.error(f"--variant takes NAME=JSON: {e}")
    policies = [p for p in args.policies.split(",") if p]
    if "unicache" not in policies or not set(policies) & set(CLASSIC):
        ap.error("--policies needs unicache and at least one classic policy")
    t0 = time.perf_counter()
    traces = []
    with foreign_trace_files(range(args.first_seed, args.first_seed + args.seeds), args.duration, BLOCK_SIZE) as files:
        for seed, name, path in files:
            run = measure(name, path, BLOCK_SIZE, False, policies, FRACS, False)
            run["results"] += variant_results(path, variants, FRACS)
            traces.append({"name": name, "seed": seed, "requests": run["requests"], "unique_blocks": run["unique_blocks"],
                           "rows": compare(run, FRACS, tuple(variants)), "results": run["results"]})
    report = {"command": "python -m bench.studies.foreign_eviction " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "duration": args.duration, "policies": policies, "variants": variants, "traces": traces, "wall_s": time.perf_counter() - t0}
    write_report(Path(args.out_dir), "foreign_eviction", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
