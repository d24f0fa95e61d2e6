"""Simulator speed of each eviction policy, as a ratio to lru in the same run, plus an
outcome fingerprint to prove that a speed-up changed no result.

Replays the Mooncake conversation trace (block size 512, classes inferred) and the
generated mix (seed 0, block size 16, labelled) at 2/5/10/25% of unique blocks, like
``bench/eviction_report.py``, and prints accesses per CPU second for each policy, the
minimum and median over capacities and repeats, and each policy's ratio to lru. CPU seconds still
vary with other jobs on the machine; the ratio to lru, measured in the same run, varies
less.

``--save PATH`` writes every result field except timings; ``--check PATH`` compares a new
run against such a file and exits 1 on any difference (hit ratios, evictions and TTFTs
must be bit-identical after a pure speed change).

Run (from the repository root):
    .venv/bin/python -m bench.sim_speed [--repeat 3] [--save ref.json | --check ref.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from unicache.sim.prepare import prepare
from unicache.sim.replay import ReplayConfig
from unicache.sim.runner import capacities_from_fracs, run_grid
from unicache.sim.trace import read_trace, write_trace
from unicache.sim.workload import WorkloadConfig, generate
from bench.paths import mooncake_trace

FRACS = [0.02, 0.05, 0.10, 0.25]
TIMING_FIELDS = {"elapsed_s", "cpu_s", "accesses_per_s"}


def replay(path: Path, block_size: int, policies: list[str], repeat: int) -> tuple[list[dict], dict[str, list[float]]]:
    """Outcome records of the first repeat, and every accesses/s of each policy."""
    trace = prepare(read_trace(path), block_size)
    caps = capacities_from_fracs(FRACS, trace.unique_blocks)
    outcomes: list[dict] = []
    speeds: dict[str, list[float]] = {}
    for rep in range(repeat):
        for r in run_grid(trace, policies, caps, ReplayConfig(policies[0], caps[0])):
            speeds.setdefault(r["policy"], []).append(r["accesses_per_s"])
            if rep == 0:
                outcomes.append({k: v for k, v in r.items() if k not in TIMING_FIELDS})
    return outcomes, speeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=mooncake_trace())
    ap.add_argument("--policies", default="lru,unicache")
    ap.add_argument("--repeat", type=int, default=1, help="replays per (trace, policy, capacity)")
    ap.add_argument("--skip", default="", help="comma list of runs to skip: mooncake, mix")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--save", type=Path, help="write the outcome fingerprint here")
    group.add_argument("--check", type=Path, help="compare outcomes with this fingerprint")
    args = ap.parse_args()
    policies = args.policies.split(",")
    skip = set(filter(None, args.skip.split(",")))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mix_path = Path(tmp) / "mix_seed0.jsonl"
        write_trace(mix_path, generate(WorkloadConfig(seed=0, duration=1200.0, block_size=16)))
        for name, path, bs in (("mooncake", args.trace, 512), ("mix", mix_path, 16)):
            if name in skip:
                continue
            outcomes, speeds = replay(path, bs, policies, args.repeat)
            runs[name] = outcomes
            for stat in (min, statistics.median):
                v = {p: stat(s) for p, s in speeds.items()}
                line = "  ".join(f"{p} {s:,.0f}/s" for p, s in v.items())
                if "lru" in v:
                    line += "  " + "  ".join(f"{p}/lru {s / v['lru']:.3f}" for p, s in v.items() if p != "lru")
                print(f"{name:<9} {stat.__name__:<6} accesses per CPU s: {line}")
    if args.save:
        args.save.write_text(json.dumps(runs, indent=1, sort_keys=True))
        print(f"wrote {args.save}")
    if args.check:
        ref = json.loads(args.check.read_text())
        # Each new record must equal the reference's record for its (policy, capacity).
        ref_by = {(name, r["policy"], r["capacity_blocks"]): r for name, recs in ref.items() for r in recs}
        bad = [
            key
            for name, recs in runs.items()
            for r in recs
            if ref_by.get(key := (name, r["policy"], r["capacity_blocks"])) != r
        ]
        if bad:
            print(f"outcomes differ from {args.check}: {bad}")
            return 1
        print(f"outcomes identical to {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
