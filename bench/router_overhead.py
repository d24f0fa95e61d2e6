"""End-to-end latency the router adds over calling a replica directly (gRPC and HTTP).

One real replica (AsyncEngine with the tiny seeded model, ReplicaServer on port 0) and a
router in front of it (static replica, so Redis is not needed; ``--with-redis`` runs an
embedded redis-server, the replica's publisher and the router's subscriber as in
production). Requests go one at a time, interleaving the three paths (direct gRPC, router
gRPC, router HTTP non-streaming) so drift hits all alike; every request has a fresh
prompt so none is a cache hit. Reports p50/p99 per path and the router's added latency
(router minus direct) at p50 and p99, and the ratio to the direct call. With the framed
hop (``--replica-transport hop``, the default) a ``direct_hop`` path calls the replica over
its hop too, and ``added_p50_ms_vs_its_hop`` subtracts the direct call over the transport
each path's last hop takes (the replica answers faster over the hop than over gRPC, so
router minus direct gRPC understates what the router itself adds).

``--bare`` adds the floors, in this process too: a bare grpc.aio proxy
(``bench.router_profile.start_bare_proxy``) and a bare HTTP proxy on uvicorn
(``bench.http_cpu.start_bare_http``), both forwarding with the cluster credential and
nothing else (paths bare_grpc, bare_http). ``--baseline-unicache EXE`` adds two router
processes in front of the same replica, run alike: this tree's ``unicache router`` (paths
tree_grpc, tree_http) and ``EXE router`` (another checkout's command; baseline_grpc,
baseline_http), each on ``--event-loop``, so the two trees are compared in one run.

Run: .venv/bin/python -m bench.router_overhead [--requests 200] [--prompt-tokens 256]
     [--max-tokens 1] [--with-redis] [--event-loop asyncio|uvloop] [--bare] [--replica-transport hop|grpc]
     [--baseline-unicache EXE] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import string
import sys
import time

import grpc
import httpx

from unicache.contract.state_auth import CallCredential, new_cluster_key, parse_cluster_key
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.replica.serving.server import ReplicaServer
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.sim.metrics import percentile
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc


# Paths whose last hop is the replica's framed hop (with --replica-transport hop): their
# "added_p50_ms_vs_its_hop" is over direct_hop, the others' over direct_grpc.
HOP_PATHS = frozenset({"direct_hop", "router_grpc", "router_http", "tree_grpc", "tree_http"})


async def run(args) -> dict:
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=4096)
    engine = AsyncEngine(EngineConfig(model=model, num_blocks=4096, block_size=16, eviction_policy="lru", device=args.device))
    await engine.start()
    key = new_cluster_key()
    server = ReplicaServer(engine, "r0", cluster_key=parse_cluster_key(key), hop_port=0)
    port = await server.start()
    addr = f"127.0.0.1:{port}"
    hop_addr = f"127.0.0.1:{server.hop_port}" if args.replica_transport == "hop" else ""
    spec = f"r0={addr}" + (f"@{hop_addr}" if hop_addr else "")  # this tree's routers; the bare proxies and a baseline use gRPC
    redis = publisher = None
    overrides = {"grpc_port": 0, "http_port": 0, "use_redis": False, "replicas": spec, "routing_policy": args.policy}
    if args.with_redis:
        from unicache.replica.publishing.publisher import CachePublisher
        from unicache.plumbing.redis_server import EmbeddedRedis

        redis = EmbeddedRedis()
        redis.start()
        publisher = CachePublisher(engine, "r0", redis.url, addr, signer=server.signer, hop_address=hop_addr)
        server.servicer.summary_source = publisher.signed_summary
        await publisher.start()
        overrides.update(use_redis=True, replicas="", redis_url=redis.url)
    # NOTE: the replica here serves without TLS (the router's overhead alone is measured): the named opt-out.
    env = {"UNICACHE_API_KEYS": "k:bench", "UNICACHE_SALT_SECRET": "s", "UNICACHE_CLUSTER_KEY": key, "UNICACHE_INSECURE_NO_TLS": "1"}
    app = RouterApp(build_config(env=env, overrides=overrides))
    call_auth = CallCredential(parse_cluster_key(key))
    await app.start()
    for _ in range(500):
        if app.cluster.replicas:
            break
        await asyncio.sleep(0.01)
    rchan = grpc.aio.insecure_channel(addr)
    replica = replica_pb2_grpc.ReplicaStub(rchan)
    gchan = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    router = router_pb2_grpc.RouterStub(gchan)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", headers={"x-api-key": "k"}, timeout=60)
    closers = []  # how to stop each optional path, run in reverse
    grpc_doors = {"router_grpc": router}
    http_doors = {"router_http": http}
    if args.bare:
        from bench.http_cpu import start_bare_http, stop_bare_http
        from bench.router_profile import start_bare_proxy

        bserver, bport, bchannels = await start_bare_proxy([addr], call_auth.metadata)

        async def stop_bare_grpc() -> None:
            await bserver.stop(0)
            for c in bchannels:
                await c.close()

        closers.append(stop_bare_grpc)
        bchan = grpc.aio.insecure_channel(f"127.0.0.1:{bport}")
        closers.append(bchan.close)
        grpc_doors["bare_grpc"] = router_pb2_grpc.RouterStub(bchan)
        hserver, htask, hport, hchannels = await start_bare_http([addr], call_auth.metadata)
        closers.append(lambda: stop_bare_http(hserver, htask, hchannels))
        http_doors["bare_http"] = httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=60)
        closers.append(http_doors["bare_http"].aclose)
    if args.baseline_unicache:
        from bench.router_profile import start_baseline

        tree = shutil.which("unicache", path=os.path.dirname(sys.executable)) or "unicache"
        env = {"UNICACHE_API_KEYS": "k:bench", "UNICACHE_SALT_SECRET": "s", "UNICACHE_CLUSTER_KEY": key, "UNICACHE_INSECURE_NO_TLS": "1",
               "UNICACHE_AUTH_ENABLED": "true", "UNICACHE_ROUTING_POLICY": args.policy, "UNICACHE_EVENT_LOOP": args.event_loop}
        for name, exe in (("tree", tree), ("baseline", args.baseline_unicache)):
            proc, gport, hport = await asyncio.to_thread(start_baseline, exe, spec if name == "tree" else f"r0={addr}", 60.0, env)

            async def stop_proc(proc=proc) -> None:
                proc.terminate()
                await asyncio.to_thread(proc.wait, 30)

            closers.append(stop_proc)
            chan = grpc.aio.insecure_channel(f"127.0.0.1:{gport}")
            closers.append(chan.close)
            grpc_doors[f"{name}_grpc"] = router_pb2_grpc.RouterStub(chan)
            http_doors[f"{name}_http"] = httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", headers={"x-api-key": "k"},
                                                           timeout=60)
            closers.append(http_doors[f"{name}_http"].aclose)
    rng = random.Random(0)
    tok = app.core.tokenizer
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens)

    def prompt() -> str:
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(args.prompt_tokens))

    async def direct() -> None:
        req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=tok.encode(prompt())), sampling=sampling)
        async for _ in replica.Generate(req, timeout=60, metadata=call_auth.metadata()):
            pass

    def via_grpc(stub):
        async def call() -> None:
            req = router_pb2.RouterGenerateRequest(text=prompt(), sampling=sampling)
            async for _ in stub.Generate(req, metadata=[("x-api-key", "k")], timeout=60):
                pass

        return call

    def via_http(client):
        async def call() -> None:
            r = await client.post("/v1/completions", json={"prompt": prompt(), "max_tokens": args.max_tokens})
            r.raise_for_status()

        return call

    direct_paths = {"direct_grpc": direct}
    if hop_addr:
        from unicache.contract.hop import HopAuth
        from unicache.router.upstream.hop_client import HopClient

        hop_client = HopClient(hop_addr, "r0", HopAuth(parse_cluster_key(key)))

        async def close_hop() -> None:
            hop_client.close()

        closers.append(close_hop)

        async def direct_hop() -> None:
            req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=tok.encode(prompt())), sampling=sampling)
            stream = hop_client.stream(req, 60)
            try:
                if await stream.first() is not None:
                    while await stream.next() is not None:
                        pass
            finally:
                stream.close()

        direct_paths["direct_hop"] = direct_hop
    paths = {**direct_paths, **{n: via_grpc(s) for n, s in grpc_doors.items()},
             **{n: via_http(c) for n, c in http_doors.items()}}
    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for i in range(args.warmup + args.requests):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                await fn()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for close in reversed(closers):
            await close()
        await http.aclose()
        await gchan.close()
        await rchan.close()
        await app.stop()
        if publisher is not None:
            await publisher.stop()
        await server.stop()
        await engine.stop()
        if redis is not None:
            redis.close()
    d50, d99 = percentile(times["direct_grpc"], 50), percentile(times["direct_grpc"], 99)
    h50, h99 = (percentile(times["direct_hop"], 50), percentile(times["direct_hop"], 99)) if "direct_hop" in times else (d50, d99)
    out = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "with_redis": args.with_redis,
        "replica_transport": args.replica_transport,
        "baseline_unicache": args.baseline_unicache,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "paths": {},
    }
    for name, xs in times.items():
        p50, p99 = percentile(xs, 50), percentile(xs, 99)
        out["paths"][name] = {
            "p50_ms": round(1e3 * p50, 3),
            "p99_ms": round(1e3 * p99, 3),
            "mean_ms": round(1e3 * statistics.fmean(xs), 3),
            "added_p50_ms": round(1e3 * (p50 - d50), 3),
            "added_p99_ms": round(1e3 * (p99 - d99), 3),
            # over the replica's own latency on the transport this path's last hop takes
            "added_p50_ms_vs_its_hop": round(1e3 * (p50 - (h50 if name in HOP_PATHS and hop_addr else d50)), 3),
            "ratio_p50_vs_direct": round(p50 / d50, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--with-redis", action="store_true")
    ap.add_argument("--bare", action="store_true", help="also bare gRPC and HTTP proxies (the floors)")
    ap.add_argument("--baseline-unicache", metavar="EXE", help="also this tree's and EXE's `router` as processes")
    ap.add_argument("--event-loop", default="asyncio", help="asyncio or uvloop (client and router share the loop)")
    ap.add_argument("--replica-transport", choices=("hop", "grpc"), default="hop",
                    help="this tree's routers reach the replica over its framed hop (production's default) or gRPC")
    ap.add_argument("--json")
    args = ap.parse_args()
    from unicache.router.frontends.http_server import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        out = runner.run(run(args))
    out["event_loop"] = args.event_loop
    print("load average", out["load_average_1m"])
    print(f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'p50/direct':>10} {'added p50 vs its hop':>21}")
    for name, r in out["paths"].items():
        print(f"{name:<12} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['added_p50_ms']:>10.2f} {r['added_p99_ms']:>10.2f} {r['ratio_p50_vs_direct']:>10.2f} {r['added_p50_ms_vs_its_hop']:>21.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
