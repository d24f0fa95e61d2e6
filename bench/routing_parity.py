"""Routing parity: the live router's policy path against the simulator, on suite slices.

For each slice (generated families of ``unicache.sim.suite`` and a Mooncake slice), the
simulated replicas publish their events and heartbeats through the real
``CachePublisher`` to a private ``redis-server``; a live ``RouterApp`` follows it, and at
every decision, once its index and heartbeats are fresh, ``RouterCore.choose`` decides
beside the simulator's policy (``unicache.testing.routing_parity``). Reports the share of
equal decisions per slice and replica count.

Run (from the repository root):
    nice -n 10 .venv/bin/python -m bench.routing_parity [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from dataclasses import asdict
from pathlib import Path

from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.sim.replay import ReplayConfig
from unicache.sim.suite import SuiteTrace, load_suite_trace
from unicache.testing.routing_parity import run_parity
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import write_report

SLICES = [SuiteTrace("balanced", "report", 0, 11), SuiteTrace("agent", "report", 1, 11),
          SuiteTrace("template", "report", 1, 11), SuiteTrace("mooncake", "report", 1, 0)]


async def one(redis: EmbeddedRedis, st: SuiteTrace, replicas: int, args, prefix: str) -> dict:
    trace = load_suite_trace(st, mooncake_path=args.trace, mooncake_slices=args.mooncake_slices,
                             duration=args.duration)
    largest = max(-(-r.num_tokens // trace.block_size) for r in trace.requests)
    cfg = ReplayConfig("unicache", 2 * largest, replicas=replicas, router=args.router, rate_scale=args.rate_scale)
    t0 = time.perf_counter()
    rec = await run_parity(redis.url, prefix, trace, cfg)
    out = {"slice": st.name, "replicas": replicas, "requests": len(trace.requests), "capacity_blocks": 2 * largest,
           "decisions": len(rec.steps), "agreement": rec.agreement,
           "reasons": dict(collections.Counter(s.sim_reason for s in rec.steps)),
           "disagreements": [asdict(s) for s in rec.steps if s.sim != s.live][:20],
           "evictions": rec.result["evictions"], "wall_s": time.perf_counter() - t0}
    print(f"  {st.name} x{replicas}: {out['decisions']} decisions, agreement {out['agreement']:.4f}", file=sys.stderr)
    return out


async def run(args) -> list[dict]:
    redis = EmbeddedRedis()
    redis.start()
    try:
        rows = []
        for i, st in enumerate(SLICES):
            for n in args.replicas:
                rows.append(await one(redis, st, n, args, f"parity{i}x{n}"))
        return rows
    finally:
        redis.close()


def markdown(report: dict) -> str:
    lines = ["# Routing parity: live router policy path vs simulator\n",
             f"Produced by `{report['command']}`. Router policy `{report['router']}`, rate scale "
             f"{report['rate_scale']}, capacity per replica 2 x the slice's largest request. Every decision: the "
             "simulator's policy on its own state, the live router's `RouterCore.choose` on the index it built from "
             "Redis and loads from heartbeats, after both are fresh.\n",
             "| slice | replicas | requests | decisions | agreement | evictions | reasons (simulator) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        lines.append(f"| {r['slice']} | {r['replicas']} | {r['requests']} | {r['decisions']} | {r['agreement']:.4f} "
                     f"| {r['evictions']} | {reasons} |")
    total = sum(r["decisions"] for r in report["rows"])
    agree = sum(r["agreement"] * r["decisions"] for r in report["rows"])
    lines.append(f"\nOverall: {agree:.0f} of {total} decisions equal ({agree / total:.4f}).\n")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(mooncake_trace()))
    ap.add_argument("--mooncake-slices", type=int, default=48, help="Mooncake cut into this many time slices (default 48)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of generated arrivals (default 90)")
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--router", default="cache_aware")
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    args.replicas = [int(x) for x in args.replicas.split(",")]
    rows = asyncio.run(run(args))
    report = {"command": "python -m bench.routing_parity " + " ".join(argv if argv is not None else sys.argv[1:]),
              "router": args.router, "rate_scale": args.rate_scale, "rows": rows}
    out = Path(args.out_dir)
    write_report(out, "routing_parity", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
