"""Overload answered: ``unicache bench`` at 1x, 2x and 4x the fleet's capacity, reporting
per multiple the share of requests refused with 429, the TTFT p99 of the admitted ones and
the deadline expiries (the target: refusals, not expiries, and the admitted keep their TTFT).

The capacity is the fleet's throughput when saturated: the first ``--capacity-requests``
requests of the generated mix sent all at once (successful requests per second), unless
``--capacity-rps`` gives it. Each multiple ``k`` then replays the ``--synthetic`` requests
at ``k`` times that rate (``rate_scale`` = k x capacity / the mix's own rate). Every
request declares its ``--timeout-s`` as OpenAI's SDK does (``x-stainless-read-timeout``),
so the router may refuse at once what it predicts cannot start in time. A line per run
(on stderr) says what it measured as it finishes.

    unicache up --replicas 2 --http-port 8000 &        # or any router endpoint
    .venv/bin/python -m bench.overload_sweep --endpoint http://127.0.0.1:8000 --synthetic 400 \\
        --out bench/results/overload_sweep.json

Figures: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

from unicache.bench_client.client import BenchConfig, fit_to_context, run_bench, served_context, synthetic_requests
from unicache.bench_client.stats import summarize


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def native_rps(requests) -> float:
    """The mix's own arrival rate: requests per second over the span of their timestamps."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    return len(requests) / span_s if span_s > 0 else math.inf


def run_multiple(cfg: BenchConfig, requests, offered_rps: float) -> dict:
    """One replay at ``offered_rps``; its summary's overload figures."""
    cfg.rate_scale = offered_rps / native_rps(requests) if math.isfinite(native_rps(requests)) else math.inf
    s = summarize(asyncio.run(run_bench(cfg, requests)), cfg.slo_ttft_s)
    return {"offered_rps": offered_rps, "requests": s["requests"], "succeeded": s["succeeded"], "refused": s["refused"],
            "refused_share": s["refused_share"], "deadline_expired": s["deadline_expired"],
            "other_failures": s["failed"] - s["refused"] - s["deadline_expired"],
            "ttft_p99_admitted_s": s["ttft_s"]["p99"], "throughput_rps": s["throughput_rps"], "errors": s["errors"]}


def table(capacity_rps: float, rows: dict[str, dict]) -> str:
    lines = [f"capacity {capacity_rps:.2f} req/s",
             "| load | offered req/s | refused (429) | TTFT p99 of admitted (ms) | deadline expired | other failures |",
             "|---|---|---|---|---|---|"]
    for k, r in rows.items():
        p99 = "-" if r["ttft_p99_admitted_s"] is None else f"{r['ttft_p99_admitted_s'] * 1000:.0f}"
        others = ", ".join(f"{kind}: {n}" for kind, n in r["errors"].items() if kind not in ("http 429", "timeout", "http 504"))
        lines.append(f"| {k} | {r['offered_rps']:.2f} | {r['refused']} of {r['requests']} ({r['refused_share']:.1%}) | {p99} "
                     f"| {r['deadline_expired']} | {r['other_failures']}{f' ({others})' if others else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True, help="router base URL")
    p.add_argument("--synthetic", type=int, default=400, help="requests of the generated mix per run (default 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="unicache-default")
    p.add_argument("--multiples", default="1,2,4", help="loads as multiples of the capacity (default 1,2,4)")
    p.add_argument("--capacity-rps", type=float, default=0.0, help="the fleet's capacity (default 0: measured first)")
    p.add_argument("--capacity-requests", type=int, default=100,
                   help="requests sent at once to measure the capacity (default 100)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="client deadline per request (default 60)")
    p.add_argument("--out", help="write the figures as JSON")
    args = p.parse_args(argv)
    requests = synthetic_requests(args.synthetic, args.seed, 16)

    def config() -> BenchConfig:
        return BenchConfig(endpoint=args.endpoint, model=args.model, timeout_s=args.timeout_s)

    context = served_context(config())  # as unicache bench does: prompts cut to the served context
    if context is not None:
        requests, _ = fit_to_context(requests, 16, context)

    capacity = args.capacity_rps
    capacity_errors: dict = {}
    if capacity <= 0:
        burst = config()
        burst.rate_scale = math.inf
        say(f"capacity: {args.capacity_requests} requests at once ...")
        t0 = time.perf_counter()
        s = summarize(asyncio.run(run_bench(burst, requests[: args.capacity_requests])), burst.slo_ttft_s)
        capacity = s["throughput_rps"]
        capacity_errors = s["errors"]
        say(f"capacity: {capacity:.2f} req/s ({s['succeeded']} of {s['requests']} answered, {time.perf_counter() - t0:.0f} s"
            f"{''.join(f', {kind}: {n}' for kind, n in capacity_errors.items())})")
        if capacity <= 0:
            raise SystemExit("no request succeeded when measuring the capacity")
    rows = {}
    for k in [m for m in args.multiples.split(",") if m]:
        say(f"{float(k):g}x: {len(requests)} requests at {float(k) * capacity:.2f} req/s ...")
        t0 = time.perf_counter()
        r = rows[f"{float(k):g}x"] = run_multiple(config(), requests, float(k) * capacity)
        say(f"{float(k):g}x: {r['succeeded']} answered, {r['refused']} refused, {r['deadline_expired']} expired, "
            f"{r['other_failures']} other failures ({time.perf_counter() - t0:.0f} s)")
    print(table(capacity, rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"endpoint": args.endpoint, "synthetic": args.synthetic, "seed": args.seed, "capacity_rps": capacity,
                       "timeout_s": args.timeout_s, "capacity_run_errors": capacity_errors,
                       "runs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
