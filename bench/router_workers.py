"""Router throughput by worker count: ``unicache router --workers 1`` against ``--workers 2``
(and any other counts), in interleaved rounds of the same run.

Processes: the fake replicas (``bench.router_profile.replicas_main``: echo, one token per
message) share one process; each router under test is a ``unicache router --workers N``
supervisor with its workers (round robin, no auth, no Redis: the forwarding cost, as in
``bench.router_profile``); this process is the client, opening ``--channels`` gRPC channels
per router (one TCP connection each, so the kernel's SO_REUSEPORT spreads them over the
workers) and sending bursts of ``--requests`` concurrent streams. Every router stays up
the whole run; each round runs every count once, the order turning each round.

Reports per count and round: requests/s, CPU per request of the workers, of the client
and of the replicas (from /proc), the busiest worker's share of the workers' CPU (the
kernel hashes each new connection to one worker, so a burst over few connections can land
unevenly) and the 1-minute load average before the burst; the
figure is the median over rounds of the per-round ratio req/s(N) / req/s(1). On a 2-core
machine the client, the replicas and the workers compete for the same cores, so that ratio
is the machine's, not the router's alone: with total CPU per request C (client + replicas +
router) and router CPU R, one worker serves at most min(1/R, 2/C) req/s and two at most 2/C,
so at the 1-worker run's CPU split the ratio can reach (2/C) / min(1/R, 2/C), reported as
``ratio_ceiling`` (an estimate: per-request CPU itself shifts with the contention, so a
round can land above it).

``--client grpc`` (default) is this process on grpc.aio, which costs about what the router
does per request and so caps the ratio near 1 on 2 cores. ``--client h2load`` sends the same
``Router.Generate`` stream from nghttp2's h2load (C; ``apt-get install nghttp2-client``):
one serialized request as a gRPC frame, ``--channels`` connections with up to
``--requests / --channels`` streams each. h2load cannot read gRPC trailers, so the bench
checks delivery itself: h2load must count every request succeeded with a 2xx, and the
replicas must have served exactly as many requests as were sent.

    .venv/bin/python -m bench.router_workers [--workers 1,2] [--requests 1000] [--rounds 5]
        [--channels 16] [--max-tokens 8] [--client grpc|h2load] [--json OUT]
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
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

from unicache.testing.procfs import child_pids, cpu_s
from bench.load_test import burst, prompt
from bench.rounds import round_order
from bench.router_profile import free_port, replica_spec, replicas_main


def grpc_frame(max_tokens: int) -> bytes:
    """One ``RouterGenerateRequest`` as a gRPC length-prefixed message (uncompressed)."""
    from unicache.v1 import common_pb2, router_pb2

    msg = router_pb2.RouterGenerateRequest(text=prompt(0), sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    body = msg.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def h2load_burst(port: int, n: int, channels: int, frame_path: str, streams: int | None = None) -> dict:
    """``n`` streams from h2load over ``channels`` connections, at most ``streams`` at once
    on each (default: all of them at once); requests/s and latency as h2load measured
    them, and its success counts (checked by the caller: a gRPC error is HTTP 200 too)."""
    streams = streams or max(1, -(-n // channels))
    cmd = ["h2load", "-n", str(n), "-c", str(channels), "-m", str(streams), "-d", frame_path,
           "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://127.0.0.1:{port}/unicache.v1.Router/Generate"]
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    client_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    grab = lambda pattern: re.search(pattern, out).groups()  # noqa: E731
    (rps,) = grab(r"finished in [\d.]+m?s, ([\d.]+) req/s")
    done, ok = grab(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded")
    (two,) = grab(r"status codes: (\d+) 2xx")
    mean_ms = grab(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(m?s)")
    return {"requests": n, "ok": int(ok), "done": int(done), "status_2xx": int(two), "wall_s": round(wall, 3),
            "requests_per_s": float(rps), "latency_mean_ms": round(float(mean_ms[0]) * (1 if mean_ms[1] == "ms" else 1e3), 2),
            "malformed_answers": 0, "errors": {}, "client_cpu_s": client_s}


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


async def drive(args, routers: dict[int, tuple[subprocess.Popen, int]], replicas_pid: int, served) -> dict:
    import grpc

    from unicache.v1 import router_pb2_grpc

    chans = {n: [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(args.channels)] for n, (_, port) in routers.items()}
    stubs = {n: [router_pb2_grpc.RouterStub(c) for c in cs] for n, cs in chans.items()}
    for s in stubs.values():
        await burst(s, 200, args.max_tokens, False)  # warm up every connection
    frame_path = ""
    if args.client == "h2load":
        fd, frame_path = tempfile.mkstemp(suffix=".grpc")
        os.write(fd, grpc_frame(args.max_tokens))
        os.close(fd)
        for n, (_, port) in routers.items():
            h2load_burst(port, 200, args.channels, frame_path)  # warm up h2load's connections too
    counts = sorted(routers)
    rounds = []
    for i in range(args.rounds):
        order = round_order(counts, i)
        rnd = {}
        for n in order:
            pids = worker_pids(routers[n][0], n)
            load1 = os.getloadavg()[0]
            c0, rep0, me0, served0 = [cpu_s(p) for p in pids], cpu_s(replicas_pid), time.process_time(), served.value
            if args.client == "h2load":
                r = await asyncio.to_thread(h2load_burst, routers[n][1], args.requests, args.channels, frame_path)
                assert r["ok"] == r["done"] == r["status_2xx"] == args.requests, r
            else:
                r = await burst(stubs[n], args.requests, args.max_tokens, False)
                assert r["ok"] == args.requests and not r["malformed_answers"], r
            assert served.value - served0 == args.requests, (served.value - served0, args.requests)
            per = lambda seconds: round(1e3 * seconds / args.requests, 3)  # noqa: E731
            spent = [cpu_s(p) - c for p, c in zip(pids, c0)]
            r["cpu_ms_per_request"] = per(sum(spent))
            # SO_REUSEPORT hashes each new connection to a worker: an uneven split of the
            # client's connections leaves one worker with more of the burst
            r["busiest_worker_cpu_share"] = round(max(spent) / sum(spent), 3) if sum(spent) > 0 else 1.0
            r["replicas_cpu_ms_per_request"] = per(cpu_s(replicas_pid) - rep0)
            # the grpc client's CPU is this process's; h2load's its own (the one child reaped meanwhile)
            r["client_cpu_ms_per_request"] = per(r.pop("client_cpu_s") if args.client == "h2load" else time.process_time() - me0)
            r["load_avg_1m"] = round(load1, 2)
            rnd[str(n)] = r
        base = rnd[str(counts[0])]["requests_per_s"]
        for n in counts:
            rnd[str(n)]["ratio_req_per_s_vs_first"] = round(rnd[str(n)]["requests_per_s"] / base, 3)
        rounds.append(rnd)
    if frame_path:
        os.unlink(frame_path)
    for cs in chans.values():
        for c in cs:
            await c.close()
    med = lambda n, k: round(statistics.median(r[str(n)][k] for r in rounds), 3)  # noqa: E731
    keys = ["requests_per_s", "ratio_req_per_s_vs_first", "cpu_ms_per_request", "replicas_cpu_ms_per_request",
            "client_cpu_ms_per_request", "load_avg_1m", "busiest_worker_cpu_share",
            "latency_p50_ms" if args.client == "grpc" else "latency_mean_ms"]
    median = {str(n): {k: med(n, k) for k in keys} for n in counts}
    # the ceiling of the module docstring, from the first count's CPU split
    first, cores = median[str(counts[0])], os.cpu_count() or 1
    router_ms = first["cpu_ms_per_request"]
    total_ms = router_ms + first["replicas_cpu_ms_per_request"] + first["client_cpu_ms_per_request"]
    median["ratio_ceiling"] = round((cores / total_ms) / min(1 / router_ms, cores / total_ms), 3)
    return {
        "config": {"workers": counts, "requests": args.requests, "rounds": args.rounds, "channels": args.channels,
                   "replica_transport": args.replica_transport,
                   "max_tokens": args.max_tokens, "replicas": args.replicas, "cpus": os.cpu_count(), "client": args.client},
        "rounds": rounds,
        "median": median,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (the first is the ratio's base)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--client", choices=("grpc", "h2load"), default="grpc",
                    help="load client: this process on grpc.aio, or nghttp2's h2load (C; see the module docstring)")
    ap.add_argument("--replica-transport", choices=("hop", "grpc"), default="hop",
                    help="the routers' replica hop: the framed hop (production's default) or gRPC")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.client == "h2load" and shutil.which("h2load") is None:
        ap.error("--client h2load needs nghttp2's h2load on PATH (Debian: apt-get install nghttp2-client)")
    counts = [int(x) for x in args.workers.split(",")]
    ctx = mp.get_context("spawn")
    ports, stop, served = ctx.Queue(), ctx.Event(), ctx.Value("q", 0)
    reps = ctx.Process(target=replicas_main, args=(args.replicas, ports, stop, served))
    reps.start()
    routers: dict[int, tuple[subprocess.Popen, int]] = {}
    try:
        _, rep_ports, rep_pid = ports.get(timeout=60)
        spec = replica_spec(rep_ports, hop=args.replica_transport == "hop")
        for n in counts:
            routers[n] = start_router(n, spec)
        result = asyncio.run(drive(args, routers, rep_pid, served))
    finally:
        for proc, _ in routers.values():
            proc.terminate()
            proc.wait(timeout=30)
        stop.set()
        reps.join(timeout=30)
    for i, rnd in enumerate(result["rounds"]):
        print(f"round {i}: " + " | ".join(
            f"{n} workers {r['requests_per_s']} req/s ({r['ratio_req_per_s_vs_first']}x), CPU {r['cpu_ms_per_request']} ms/req, "
            f"busiest worker {r['busiest_worker_cpu_share']:.0%} of it, load {r['load_avg_1m']}" for n, r in rnd.items()))
    for n in map(str, counts):
        m = result["median"][n]
        client = f", client {m['client_cpu_ms_per_request']} ms/req"
        print(f"median {n} workers: {m['requests_per_s']} req/s, per-round ratio to {counts[0]} worker(s) "
              f"{m['ratio_req_per_s_vs_first']}x, CPU router {m['cpu_ms_per_request']} ms/req, replicas "
              f"{m['replicas_cpu_ms_per_request']} ms/req{client}, load average {m['load_avg_1m']}")
    print(f"ceiling of the ratio from the 1-worker CPU split on {os.cpu_count()} cores: {result['median']['ratio_ceiling']}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
