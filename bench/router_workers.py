"""Router throughput by worker count: ``unicache router --workers 1`` against ``--workers 2``
(and any other counts), in interleaved rounds of the same run.

Processes: the fake replicas (``bench.router_profile.replicas_main``: echo, one token per
message) share one process; each router under test is a ``unicache router --workers N``
supervisor with its workers (round robin, no auth, no Redis: the forwarding cost, as in
``bench.router_profile``); this process is the client, opening ``--channels`` gRPC channels
per router (one TCP connection each, so the kernel's SO_REUSEPORT spreads them over the
workers) and sending bursts of ``--requests`` concurrent streams. Every router stays up
the whole run; each round runs every count once, the order turning each round.

Reports per count and round: requests/s, CPU per request (all worker processes, from
/proc) and the 1-minute load average before the burst; the figure is the median over
rounds of the per-round ratio req/s(N) / req/s(1). On a shared 2-core machine the client,
the replicas and the workers compete for the same cores, so that ratio is the machine's,
not the router's alone.

    .venv/bin/python -m bench.router_workers [--workers 1,2] [--requests 1000] [--rounds 5]
        [--channels 16] [--max-tokens 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.load_test import burst
from bench.router_profile import free_port, replicas_main
from unicache.testing.procfs import child_pids, cpu_s


def start_router(workers: int, spec: str, timeout_s: float = 90.0) -> tuple[subprocess.Popen, int]:
    """``unicache router --workers N`` on fresh fixed ports; returns it and its gRPC port
    once every worker answers (a channel is ready and N workers are alive)."""
    import grpc

    gport, hport = free_port(), free_port()
    env = dict(os.environ, UNICACHE_USE_REDIS="false", UNICACHE_AUTH_ENABLED="false", UNICACHE_ROUTING_POLICY="round_robin",
               UNICACHE_REPLICAS=spec)
    exe = shutil.which("unicache", path=os.path.dirname(sys.executable)) or "unicache"
    proc = subprocess.Popen([exe, "router", "--workers", str(workers), "--grpc-port", str(gport), "--http-port", str(hport),
                             "--log-level", "warning"], env=env, cwd=tempfile.mkdtemp())
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    while len(child_pids(proc.pid)) < workers if workers > 1 else False:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"--workers {workers}: workers did not start within {timeout_s:g} s")
        time.sleep(0.2)
    time.sleep(2.0)  # let every worker finish starting (the channel answered from one)
    return proc, gport


def worker_pids(proc: subprocess.Popen, workers: int) -> list[int]:
    return child_pids(proc.pid) if workers > 1 else [proc.pid]


async def drive(args, routers: dict[int, tuple[subprocess.Popen, int]]) -> dict:
    import grpc

    from unicache.v1 import router_pb2_grpc

    chans = {n: [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(args.channels)] for n, (_, port) in routers.items()}
    stubs = {n: [router_pb2_grpc.RouterStub(c) for c in cs] for n, cs in chans.items()}
    for s in stubs.values():
        await burst(s, 200, args.max_tokens, False)  # warm up every connection
    counts = sorted(routers)
    rounds = []
    for i in range(args.rounds):
        order = counts[i % len(counts):] + counts[: i % len(counts)]
        rnd = {}
        for n in order:
            pids = worker_pids(routers[n][0], n)
            load1 = os.getloadavg()[0]
            c0 = sum(cpu_s(p) for p in pids)
            r = await burst(stubs[n], args.requests, args.max_tokens, False)
            assert r["ok"] == args.requests and not r["malformed_answers"], r
            r["cpu_ms_per_request"] = round(1e3 * (sum(cpu_s(p) for p in pids) - c0) / args.requests, 3)
            r["load_avg_1m"] = round(load1, 2)
            rnd[str(n)] = r
        base = rnd[str(counts[0])]["requests_per_s"]
        for n in counts:
            rnd[str(n)]["ratio_req_per_s_vs_first"] = round(rnd[str(n)]["requests_per_s"] / base, 3)
        rounds.append(rnd)
    for cs in chans.values():
        for c in cs:
            await c.close()
    med = lambda n, k: round(statistics.median(r[str(n)][k] for r in rounds), 3)  # noqa: E731
    return {
        "config": {"workers": counts, "requests": args.requests, "rounds": args.rounds, "channels": args.channels,
                   "max_tokens": args.max_tokens, "replicas": args.replicas, "cpus": os.cpu_count()},
        "rounds": rounds,
        "median": {str(n): {k: med(n, k) for k in ("requests_per_s", "ratio_req_per_s_vs_first", "cpu_ms_per_request",
                                                   "latency_p50_ms", "load_avg_1m")} for n in counts},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (the first is the ratio's base)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    reps = ctx.Process(target=replicas_main, args=(args.replicas, ports, stop))
    reps.start()
    routers: dict[int, tuple[subprocess.Popen, int]] = {}
    try:
        _, rep_ports, _ = ports.get(timeout=60)
        spec = ",".join(f"r{i}=127.0.0.1:{p}" for i, p in enumerate(rep_ports))
        for n in counts:
            routers[n] = start_router(n, spec)
        result = asyncio.run(drive(args, routers))
    finally:
        for proc, _ in routers.values():
            proc.terminate()
            proc.wait(timeout=30)
        stop.set()
        reps.join(timeout=30)
    for i, rnd in enumerate(result["rounds"]):
        print(f"round {i}: " + " | ".join(
            f"{n} workers {r['requests_per_s']} req/s ({r['ratio_req_per_s_vs_first']}x), CPU {r['cpu_ms_per_request']} ms/req, "
            f"load {r['load_avg_1m']}" for n, r in rnd.items()))
    for n, m in result["median"].items():
        print(f"median {n} workers: {m['requests_per_s']} req/s, per-round ratio to {counts[0]} worker(s) "
              f"{m['ratio_req_per_s_vs_first']}x, CPU {m['cpu_ms_per_request']} ms/req, p50 {m['latency_p50_ms']} ms, "
              f"load average {m['load_avg_1m']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
