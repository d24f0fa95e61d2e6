"""The router's CPU per streamed request on its HTTP front door, driven by a C client.

The router (``RouterApp``: httptools, uvloop, round robin, no auth, no Redis; ``bench.http_cpu
.router_main``) runs in its own process in front of 4 fake replicas over the framed hop
(one process, ``bench.router_profile.replicas_main``), and nghttp2's ``h2load`` (HTTP/1.1,
keep-alive connections) sends streamed ``/v1/completions`` requests of ``--max-tokens``
tokens. Figures per round, from /proc: the router process's CPU (all threads) per request,
the replicas' CPU per request, h2load's requests/s; medians over rounds. ``--step-ms``: the
replicas make one token per running stream every that many milliseconds, as a batching
engine does (0: every token at once, the cheapest replica, which also lets the router's
writes of one response coalesce).

Being one file over ``bench.http_cpu`` and ``bench.router_profile``, it can measure another
checkout with ``bench.ab_commits --copy bench/http_door_cpu.py``.

Run (from the repository root; ``apt-get install nghttp2-client`` for h2load):
    .venv/bin/python -m bench.http_door_cpu [--requests 4000] [--rounds 3] [--step-ms 0]
        [--concurrency 16] [--max-tokens 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from unicache.testing.procfs import cpu_s
from bench.bare_http import h2load
from bench.http_cpu import router_main
from bench.router_profile import replica_spec, replicas_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if shutil.which("h2load") is None:
        ap.error("h2load not found (apt-get install nghttp2-client)")
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=replicas_main, args=(4, ports, stop, None, args.step_ms / 1e3))]
    procs[0].start()
    _, rep_ports, rep_pid = ports.get(timeout=120)
    procs.append(ctx.Process(target=router_main, args=(replica_spec(rep_ports, hop=True), "httptools", "uvloop", ports, stop)))
    procs[1].start()
    _, port, pid = ports.get(timeout=120)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        body.write_text(json.dumps({"prompt": "request " + "x" * 40, "max_tokens": args.max_tokens, "stream": True,
                                    "temperature": 0}))
        try:
            h2load(port, 200, str(body), args.concurrency)  # warm-up
            for i in range(args.rounds):
                c0, r0 = cpu_s(pid), cpu_s(rep_pid)
                res = h2load(port, args.requests, str(body), args.concurrency)
                row = {"router_cpu_ms_per_request": 1e3 * (cpu_s(pid) - c0) / args.requests,
                       "replicas_cpu_ms_per_request": 1e3 * (cpu_s(rep_pid) - r0) / args.requests,
                       "requests_per_s": res["requests_per_s"], "succeeded": res["succeeded"]}
                rounds.append(row)
                print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join(30)
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "succeeded"}
    report = {"command": "python -m bench.http_door_cpu " + " ".join(sys.argv[1:] if argv is None else argv),
              "requests": args.requests, "step_ms": args.step_ms, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "all_succeeded": all(r["succeeded"] == args.requests for r in rounds),
              "load_average_end": os.getloadavg()[0], "median": median, "rounds": rounds}
    print(json.dumps(report["median"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["all_succeeded"] else 1


if __name__ == "__main__":
    sys.exit(main())
