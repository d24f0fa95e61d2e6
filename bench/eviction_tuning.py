"""Tuning-set replays for the eviction policies: generated mixes of seeds the report never uses.

The reported figures (bench/eviction_report.py) come from mix seed 0 and the Mooncake
trace; defaults are chosen here, on other seeds (100 and up by convention), so the report
is on data the defaults were not tuned on. For every seed, with labels given or hidden,
and every capacity, prints each policy's block hit ratio and unicache's margin over the
best of the other policies listed (negative: it loses).

    python -m bench.eviction_tuning --seeds 100,101,102,103 [--labels hidden,labelled]
        [--policies arc,s3fifo,lfu,lecar,unicache] [--variant NAME=JSON_KWARGS ...]

``--variant`` adds an ``AblationUniCache`` (bench/unicache_variants.py) built with those
keyword arguments, reported under NAME.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs
from bench.mix_traces import mix_requests
from bench.unicache_variants import AblationUniCache


def mix_trace(seed: int, duration: float, block_size: int, ignore_labels: bool):
    return prepare(mix_requests(seed, duration, block_size), block_size, ignore_labels=ignore_labels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="100,101,102,103")
    ap.add_argument("--labels", default="hidden,labelled", help="comma list of hidden, labelled")
    ap.add_argument("--policies", default="arc,s3fifo,lfu,lecar,unicache")
    ap.add_argument("--fracs", default="0.02,0.05,0.10,0.25")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--variant", action="append", default=[], help="NAME=JSON kwargs of AblationUniCache")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    args = ap.parse_args(argv)
    fracs = [float(f) for f in args.fracs.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    variants = [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in args.variant]
    names = policies + [n for n, _ in variants]
    rows = []
    print("| seed | labels | capacity | " + " | ".join(names) + " | unicache - best other |")
    print("|---" * (len(names) + 4) + "|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for labels in args.labels.split(","):
            trace = mix_trace(seed, args.duration, args.block_size, labels == "hidden")
            for frac, cap in zip(fracs, capacities_from_fracs(fracs, trace.unique_blocks)):
                hits = {}
                for p in policies:
                    hits[p] = Replay(trace, ReplayConfig(p, cap)).run()["block_hit_ratio"]
                for name, kw in variants:
                    cfg = ReplayConfig("unicache", cap, policy_kwargs=kw, policy_factory=AblationUniCache)
                    hits[name] = Replay(trace, cfg).run()["block_hit_ratio"]
                others = [v for k, v in hits.items() if k in policies and k != "unicache"]
                margin = {n: hits[n] - max(others) for n in names if others and (n == "unicache" or n in dict(variants))}
                rows.append({"seed": seed, "labels": labels, "frac": frac, "hits": hits, "margin": margin})
                cells = " | ".join(f"{100 * hits[n]:.2f}" for n in names)
                mcell = ", ".join(f"{n} {100 * m:+.2f}" for n, m in margin.items())
                print(f"| {seed} | {labels} | {frac:.0%} | {cells} | {mcell} |", flush=True)
    if rows:
        for n in rows[0]["margin"]:
            ms = [r["margin"][n] for r in rows]
            print(f"{n}: mean margin {100 * sum(ms) / len(ms):+.3f}, worst {100 * min(ms):+.3f}, "
                  f"rows lost {sum(m < 0 for m in ms)}/{len(ms)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
