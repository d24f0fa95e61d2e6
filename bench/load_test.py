"""Load test: N concurrent streaming requests through the router to 4 replicas, each in
its own process on loopback, plus an overload phase; writes bench/results/load_test.{json,md}.

Phases (same processes throughout):
  1. baseline: the burst sent straight to the replicas (client round-robins), no router;
  2. router: the same burst through the router (gRPC), twice (RSS must not keep growing);
  3. overload: the burst through a second router with ``--shed-max-in-flight``: every
     request is either served or refused with RESOURCE_EXHAUSTED, nothing else.
Checks: every request answered exactly once with the expected token count; reports
throughput, p50/p99 latency (and as ratios to the baseline of the same run), and RSS
(before, after each burst, peak VmHWM) of every process.

    .venv/bin/python -m bench.load_test [--requests 1000] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from bench.paths import RESULTS

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FAST_MODEL = dict(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=512)


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


def replica_main(rid: str, ports, stop) -> None:
    async def run() -> None:
        from unicache.replica.engines.builtin.async_engine import AsyncEngine
        from unicache.replica.engines.builtin.config import EngineConfig
        from unicache.replica.engines.builtin.model import ModelConfig
        from unicache.replica.serving.server import ReplicaServer

        cfg = EngineConfig(
            model=ModelConfig(**FAST_MODEL), num_blocks=2048, block_size=16, eviction_policy="lru", device="cpu",
            cpu_threads=1, max_num_seqs=128, max_num_batched_tokens=8192,
        )
        engine = AsyncEngine(cfg)
        await engine.start()
        server = ReplicaServer(engine, rid)
        ports.put((rid, await server.start(), os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop()
        await engine.stop()

    asyncio.run(run())


def router_main(name: str, replicas: str, max_in_flight: int, ports, stop) -> None:
    async def run() -> None:
        from unicache.router.app import RouterApp
        from unicache.router.config import build_config

        cfg = build_config(env={}, overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False,
            "routing_policy": "round_robin", "replicas": replicas, "max_in_flight": max_in_flight,
        })
        app = RouterApp(cfg)
        await app.start()
        ports.put((name, app.grpc_port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await app.stop()

    asyncio.run(run())


def prompt(i: int) -> str:
    return f"load {i:05d} " + "abcdefghijklmnopqrstuvwxyz0123456789"[: i % 37]


def join_children(children, timeout_s: float = 30.0) -> None:
    """Join each child process (after its stop event is set), terminating one that does
    not end within ``timeout_s``."""
    for c in children:
        c.join(timeout=timeout_s)
        if c.is_alive():
            c.terminate()


async def burst(targets: list, n: int, max_tokens: int, direct: bool) -> dict:
    """n concurrent streams; targets are stubs (round robin over them)."""
    import grpc

    from unicache.v1 import common_pb2, replica_pb2, router_pb2

    async def one(i: int):
        stub = targets[i % len(targets)]
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
        if direct:
            req = replica_pb2.GenerateRequest(request_id=f"d{i}-{time.monotonic_ns()}", text=prompt(i), sampling=sampling)
        else:
            req = router_pb2.RouterGenerateRequest(text=prompt(i), sampling=sampling)
        t0 = time.perf_counter()
        ttft, tokens, finishes = None, 0, 0
        try:
            async for m in stub.Generate(req, timeout=300):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += len(m.token_ids)
                finishes += bool(m.finish_reason)
        except grpc.aio.AioRpcError as exc:
            return ("error", exc.code().name, time.perf_counter() - t0)
        return ("ok", (tokens, finishes, ttft), time.perf_counter() - t0)

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    ok = [r for r in res if r[0] == "ok"]
    errors: dict[str, int] = {}
    for r in res:
        if r[0] == "error":
            errors[r[1]] = errors.get(r[1], 0) + 1
    lat = sorted(r[2] for r in ok)
    ttfts = sorted(r[1][2] for r in ok)
    bad_counts = sum(1 for r in ok if r[1][1] != 1 or not 1 <= r[1][0] <= max_tokens)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    return {
        "requests": n,
        "ok": len(ok),
        "errors": errors,
        "malformed_answers": bad_counts,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 1),
        "tokens_per_s": round(sum(r[1][0] for r in ok) / wall, 1),
        "latency_p50_ms": round(q(lat, 0.5) * 1e3, 1),
        "latency_p99_ms": round(q(lat, 0.99) * 1e3, 1),
        "ttft_p50_ms": round(q(ttfts, 0.5) * 1e3, 1),
        "ttft_p99_ms": round(q(ttfts, 0.99) * 1e3, 1),
        "mean_tokens": round(statistics.mean(r[1][0] for r in ok), 2) if ok else 0,
    }


async def drive(args, procs: dict[str, int], rep_ports: dict[str, int], router_port: int, shed_port: int) -> dict:
    import grpc

    from unicache.v1 import replica_pb2_grpc, router_pb2_grpc

    def snap() -> dict:
        return {name: rss_kib(pid) for name, pid in procs.items()}

    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in rep_ports.values()]
    rchan = grpc.aio.insecure_channel(f"127.0.0.1:{router_port}")
    schan = grpc.aio.insecure_channel(f"127.0.0.1:{shed_port}")
    direct = [replica_pb2_grpc.ReplicaStub(c) for c in chans]
    router = [router_pb2_grpc.RouterStub(rchan)]
    shed = [router_pb2_grpc.RouterStub(schan)]
    await burst(router, 50, args.max_tokens, False)  # warm up
    out = {"rss_kib": {"before": snap()}}
    out["baseline_direct"] = await burst(direct, args.requests, args.max_tokens, True)
    out["router_1"] = await burst(router, args.requests, args.max_tokens, False)
    out["rss_kib"]["after_router_1"] = snap()
    out["router_2"] = await burst(router, args.requests, args.max_tokens, False)
    out["rss_kib"]["after_router_2"] = snap()
    out["overload"] = await burst(shed, args.requests, args.shed_max_tokens, False)
    out["rss_kib"]["after_overload"] = snap()
    for c in [*chans, rchan, schan]:
        await c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--shed-max-in-flight", type=int, default=50)
    ap.add_argument("--shed-max-tokens", type=int, default=32, help="longer streams in the overload phase, so requests overlap")
    ap.add_argument("--out", default=str(RESULTS / "load_test"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    children = [ctx.Process(target=replica_main, args=(f"r{i}", ports, stop)) for i in range(args.replicas)]
    for c in children:
        c.start()
    procs, rep_ports = {}, {}
    try:
        for _ in children:
            rid, port, pid = ports.get(timeout=120)
            rep_ports[rid], procs[rid] = port, pid
        spec = ",".join(f"{r}=127.0.0.1:{p}" for r, p in sorted(rep_ports.items()))
        routers = [
            ctx.Process(target=router_main, args=("router", spec, 4096, ports, stop)),
            ctx.Process(target=router_main, args=("router_shed", spec, args.shed_max_in_flight, ports, stop)),
        ]
        for r in routers:
            r.start()
        children += routers
        rports = {}
        for _ in routers:
            name, port, pid = ports.get(timeout=120)
            rports[name], procs[name] = port, pid
        procs["client"] = os.getpid()
        result = asyncio.run(drive(args, procs, rep_ports, rports["router"], rports["router_shed"]))
    finally:
        stop.set()
        join_children(children)
    result["config"] = {
        "requests": args.requests, "max_tokens": args.max_tokens, "replicas": args.replicas,
        "shed_max_in_flight": args.shed_max_in_flight, "shed_max_tokens": args.shed_max_tokens, "model": FAST_MODEL, "cpus": os.cpu_count(),
    }
    base, r1 = result["baseline_direct"], result["router_1"]
    result["ratios_router_1_vs_direct"] = {
        k: round(r1[k] / base[k], 3) for k in ("requests_per_s", "latency_p50_ms", "latency_p99_ms", "ttft_p50_ms") if base[k]
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(render_md(result))
    print(render_md(result))


def render_md(r: dict) -> str:
    c = r["config"]
    lines = [
        "# Load test (bench/load_test.py)",
        "",
        f"{c['requests']} concurrent gRPC streams, max_tokens {c['max_tokens']}, {c['replicas']} replica processes "
        f"(1-layer hidden-64 model, CPU), round-robin router process; host with {c['cpus']} CPUs shared with other jobs.",
        "",
        "| phase | ok | errors | malformed | wall s | req/s | tok/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("baseline_direct", "router_1", "router_2", "overload"):
        p = r[phase]
        lines.append(
            f"| {phase} | {p['ok']} | {p['errors'] or 0} | {p['malformed_answers']} | {p['wall_s']} | {p['requests_per_s']} | "
            f"{p['tokens_per_s']} | {p['latency_p50_ms']} | {p['latency_p99_ms']} | {p['ttft_p50_ms']} | {p['ttft_p99_ms']} |"
        )
    lines += ["", f"Router vs direct (same run): {r['ratios_router_1_vs_direct']}", "",
              f"Overload phase: a second router with max_in_flight {c['shed_max_in_flight']}, max_tokens {c['shed_max_tokens']}; "
              f"served {r['overload']['ok']}, refused {r['overload']['errors']} (nothing else may appear). How many are "
              "refused varies from run to run (one client process opens the streams, and the replicas drain them "
              "meanwhile); the exact shedding counts are asserted in tests/e2e/test_load_shedding.py.", "",
              "| process | RSS before MiB | after burst 1 | after burst 2 | after overload | peak (VmHWM) MiB |", "|---|---|---|---|---|---|"]
    rss = r["rss_kib"]
    for name in rss["before"]:
        row = [rss[k][name]["VmRSS"] / 1024 for k in ("before", "after_router_1", "after_router_2", "after_overload")]
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {rss['after_overload'][name]['VmHWM'] / 1024:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
