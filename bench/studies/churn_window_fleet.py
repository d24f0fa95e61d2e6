"""cache_aware's churn window at fleet scale (issue 17's 1,024-replica fleet): a fixed
window of 256 requests against one that grows with the fleet
(``cache_aware.CHURN_WINDOW_PER_REPLICA`` = 32 requests per replica past 8 replicas).

The churn term compares each replica's decayed inflow of new prompt tokens with the mean.
With 256 requests in the window and 1,024 replicas, most replicas hold no inflow, and one
that just took a new prompt stands at hundreds of times the mean, so the term outweighs
any prefix hit there. 32 per replica is the default window's own ratio at 8 replicas (the
largest fleet the defaults were chosen at), not a tuned value; at 4 and 8 replicas both
variants are the same policy.

Each cell is one ``unicache sim`` run (unicache eviction) in a subprocess with
``CHURN_WINDOW_PER_REPLICA`` set: 0 gives the fixed window, 32 the shipped rule; sglang
runs once per workload as the reference. Workloads: the Mooncake conversation trace at
1,024 replicas (200 blocks each, rate x 64: the README's ``sim_1024`` row) and a generated
mix of a seed no report uses (200, 3,600 s) at 256 and 1,024 replicas.

    .venv/bin/python -m bench.studies.churn_window_fleet [--jobs 2] [--out bench/results/churn_window_fleet]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
MIX_SEED, MIX_DURATION_S = 200, 3600.0

# workload name -> (trace key, block size, replicas, capacity blocks per replica, rate scale)
WORKLOADS = {
    "mooncake@1024": ("mooncake", 512, 1024, 200, 64),
    "mix200@256": ("mix", 16, 256, 400, 16),
    "mix200@1024": ("mix", 16, 1024, 100, 64),
}
VARIANTS = {"fixed 256": ("cache_aware", 0), "32 per replica (shipped)": ("cache_aware", 32), "sglang": ("sglang", 32)}

_RUN = """
import sys
import unicache.router.routing.cache_aware as m
m.CHURN_WINDOW_PER_REPLICA = int(sys.argv[1])
from unicache.cli import main
sys.argv = ['unicache'] + sys.argv[2:]
sys.exit(main())
"""


def run_cell(trace: Path, block: int, replicas: int, capacity: int, rate: int, router: str, per_replica: int, out: Path) -> dict:
    cmd = [sys.executable, "-c", _RUN, str(per_replica), "sim", "--trace", str(trace), "--block-size", str(block),
           "--replicas", str(replicas), "--router", router, "--policies", "unicache", "--capacity-blocks", str(capacity),
           "--rate-scale", str(rate), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    (r,) = json.loads(out.read_text())["results"]
    return {k: r[k] for k in ("token_hit_ratio", "load_imbalance", "ttft_mean_s", "ttft_p90_s", "ttft_p99_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "churn_window_fleet")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    mix = tmp / "mix.jsonl"
    subprocess.run([sys.executable, "-m", "unicache.cli", "gen-workload", "--out", str(mix), "--seed", str(MIX_SEED),
                    "--duration", str(MIX_DURATION_S)], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    traces = {"mooncake": MOONCAKE, "mix": mix}
    cells = [(w, v) for w in WORKLOADS for v in VARIANTS]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            (w, v): pool.submit(run_cell, traces[WORKLOADS[w][0]], *WORKLOADS[w][1:], *VARIANTS[v], tmp / f"{i}.json")
            for i, (w, v) in enumerate(cells)
        }
        results = {}
        for (w, v), f in futures.items():
            results.setdefault(w, {})[v] = f.result()
            print(f"{w} {v}: {results[w][v]}", flush=True)
    report = {"command": "python -m bench.studies.churn_window_fleet", "cpus": os.cpu_count(), "results": results}
    lines = ["# cache_aware's churn window at fleet scale", "",
             "`python -m bench.studies.churn_window_fleet` (simulated; unicache eviction). Fixed: the 256-request window at every "
             "fleet size; shipped: max(256, 32 x replicas).", "",
             "| workload | variant | token hit % | load imbalance | TTFT mean / p90 / p99 s |", "|---|---|---|---|---|"]
    for w, by_variant in results.items():
        for v, r in by_variant.items():
            lines.append(f"| {w} | {v} | {100 * r['token_hit_ratio']:.2f} | {r['load_imbalance']:.2f} | "
                         f"{r['ttft_mean_s']:.3f} / {r['ttft_p90_s']:.3f} / {r['ttft_p99_s']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
