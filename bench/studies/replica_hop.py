"""The router -> replica hop (issue 17): which options make the relay cheaper.

Two questions, each answered in interleaved rounds of one run, router CPU per request
from /proc (all threads of the router process):

``channels``: one shared grpc.aio channel per replica (production, ``ReplicaClients``)
against a pool of k channels per replica (``PooledReplicaClients`` below: calls spread
round robin over k channels, each its own TCP connection: a local subchannel pool).
Fake replicas (echo, one token per message, ``bench.router_profile.replicas_main``); a
burst of ``--requests`` concurrent gRPC streams of ``--max-tokens`` tokens per router.

``coalesce``: a real replica (the built-in engine, the tiny seeded model on CPU) sending
one message per engine output (production: one per engine step and sample), against a
replica whose engine merges the outputs of a sample that already wait for the server when
it asks for the next (``CoalescingEngine`` below: it never waits for one, so no token is
delayed; vLLM's output collector does the same with DELTA outputs). Each variant has its
own replica process and router process (round robin, static replica); a burst of
``--streams`` concurrent greedy streams of ``--stream-tokens`` tokens. Reported: messages
and tokens per request the client received, router and replica CPU per request, time to
first token and end-to-end latency p50, tokens/s; the study fails if any request's text
differs between the variants.

    .venv/bin/python -m bench.studies.replica_hop [--parts channels,coalesce] [--rounds 3]
        [--requests 1000] [--max-tokens 8] [--pools 1,2,4] [--streams 64] [--stream-tokens 32]
        [--out bench/results/replica_hop]
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

from bench.load_test import burst, join_children
from bench.rounds import round_order
from bench.router_profile import replica_spec, replicas_main
from unicache.replica.engine.api import EngineOutput
from unicache.replica.engine.async_engine import AsyncEngine
from unicache.router.replica_client import ReplicaClients
from unicache.testing.procfs import cpu_s

RESULTS = Path(__file__).resolve().parents[1] / "results"


class PooledReplicaClients(ReplicaClients):
    """``ReplicaClients`` with ``pool`` channels per replica address, used in turn."""

    def __init__(self, pool: int, **kwargs):
        super().__init__(**kwargs)
        self.pool = pool
        self._pools: dict[str, list] = {}
        self._turn = 0

    def _entry(self, address: str):
        entries = self._pools.get(address)
        if entries is None:
            # NOTE: a local subchannel pool per channel: channels with equal arguments
            # would otherwise share one connection.
            options = self._options + [("grpc.use_local_subchannel_pool", 1)]
            entries = self._pools[address] = [self._connect(address, options) for _ in range(self.pool)]
        self._turn += 1
        return entries[self._turn % len(entries)]

    async def close(self) -> None:
        channels = [e[0] for entries in self._pools.values() for e in entries]
        self._pools.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def merge_outputs(first: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One output standing for two consecutive outputs of one sample (``first`` unfinished)."""
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or []) + (later.logprobs or [])
    return EngineOutput(first.request_id, first.index, first.new_token_ids + later.new_token_ids,
                        first.text_delta + later.text_delta, later.finished, later.finish_reason,
                        later.usage if later.usage is not None else first.usage, logprobs)


class CoalescingEngine(AsyncEngine):
    """``AsyncEngine`` whose streams merge, per sample, the outputs already queued for the
    consumer when it takes one (never waiting for more)."""

    async def generate(self, req):
        inner = super().generate(req)
        try:
            async for out in inner:
                merged = {out.index: out}
                stream = self._streams.get(req.request_id)
                failure = None
                while stream is not None and stream.queue.qsize():
                    try:
                        nxt = await inner.__anext__()  # queued: returns at once
                    except StopAsyncIteration:
                        break
                    except Exception as exc:  # noqa: BLE001 - raised after the merged outputs
                        failure = exc
                        break
                    prev = merged.get(nxt.index)
                    merged[nxt.index] = nxt if prev is None else merge_outputs(prev, nxt)
                for m in merged.values():
                    yield m
                if failure is not None:
                    raise failure
        finally:
            await inner.aclose()


def router_main(spec: str, pool: int, ports, stop) -> None:
    """A router (round robin, no auth, no Redis) whose replica clients use ``pool``
    channels per replica (1: production's ``ReplicaClients``)."""
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config

    async def run() -> None:
        cfg = build_config(env={}, overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False,
            "routing_policy": "round_robin", "replicas": spec, "event_loop": "asyncio",
        })
        app = RouterApp(cfg)
        if pool > 1:
            clients = PooledReplicaClients(pool, forward_deadline_s=cfg.forward_deadline_s)
            app.clients = app.core.clients = app.prober.clients = clients
        await app.start()
        ports.put(("router", app.grpc_port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await app.stop()

    asyncio.run(run())


def engine_replica_main(coalescing: bool, ports, stop) -> None:
    """One real replica: the built-in engine (tiny seeded model, CPU) behind ReplicaServer."""

    async def run() -> None:
        from unicache.replica.engine.config import EngineConfig
        from unicache.replica.engine.model import ModelConfig
        from unicache.replica.server import ReplicaServer

        model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=4096)
        engine = (CoalescingEngine if coalescing else AsyncEngine)(EngineConfig(model=model, num_blocks=8192, block_size=16, eviction_policy="lru", device="cpu"))
        await engine.start()
        server = ReplicaServer(engine, "r0")
        port = await server.start()
        ports.put(("replica", port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop()
        await engine.stop()

    asyncio.run(run())


async def stream_burst(port: int, n: int, max_tokens: int, tag: str) -> dict:
    """n concurrent greedy streams through the router at ``port``; per request: messages,
    tokens, text, TTFT, end-to-end latency."""
    import grpc

    from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i: int):
            req = router_pb2.RouterGenerateRequest(text=f"{tag} stream {i:04d} " + "lorem ipsum " * (i % 7), sampling=sampling)
            t0 = time.perf_counter()
            ttft, messages, tokens, text = None, 0, 0, []
            async for m in stub.Generate(req, timeout=300):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                messages += 1
                tokens += len(m.token_ids)
                text.append(m.text)
            return messages, tokens, "".join(text), ttft, time.perf_counter() - t0

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {
        "messages_per_request": round(statistics.mean(r[0] for r in res), 2),
        "tokens_per_request": round(statistics.mean(r[1] for r in res), 2),
        "ttft_p50_ms": round(1e3 * statistics.median(r[3] for r in res), 2),
        "latency_p50_ms": round(1e3 * statistics.median(r[4] for r in res), 2),
        "tokens_per_s": round(sum(r[1] for r in res) / wall, 1),
        "texts": [r[2] for r in res],
    }


def start(ctx, target, args, ports) -> tuple[mp.Process, int, int]:
    proc = ctx.Process(target=target, args=args)
    proc.start()
    _, port, pid = ports.get(timeout=120)
    return proc, port, pid


async def channels_part(args, ctx, ports, stop, children) -> dict:
    import grpc

    from unicache.v1 import router_pb2_grpc

    reps = ctx.Process(target=replicas_main, args=(4, ports, stop))
    reps.start()
    children.append(reps)
    _, rep_ports, _ = ports.get(timeout=60)
    spec = replica_spec(rep_ports)  # the study compares gRPC channel pools
    front = {}
    for k in args.pools:
        proc, port, pid = start(ctx, router_main, (spec, k, ports, stop), ports)
        children.append(proc)
        front[f"pool_{k}"] = (port, pid)
    chans = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (port, _) in front.items()}
    stubs = {name: [router_pb2_grpc.RouterStub(c)] for name, c in chans.items()}
    for stub in stubs.values():
        await burst(stub, 100, args.max_tokens, False)
    rounds = []
    names = list(front)
    for r in range(args.rounds):
        rnd = {}
        for name in round_order(names, r):
            c0 = cpu_s(front[name][1])
            res = await burst(stubs[name], args.requests, args.max_tokens, False)
            assert res["ok"] == args.requests and not res["malformed_answers"], (name, res)
            rnd[name] = {"cpu_ms_per_request": round(1e3 * (cpu_s(front[name][1]) - c0) / args.requests, 3),
                         "requests_per_s": res["requests_per_s"]}
        for name in names:
            rnd[name]["ratio_cpu_vs_pool_1"] = round(rnd[name]["cpu_ms_per_request"] / rnd["pool_1"]["cpu_ms_per_request"], 3)
        rounds.append(rnd)
    for c in chans.values():
        await c.close()
    median = {n: {k: round(statistics.median(x[n][k] for x in rounds), 3) for k in rounds[0][n]} for n in names}
    return {"rounds": rounds, "median": median}


async def coalesce_part(args, ctx, ports, stop, children) -> dict:
    front = {}
    for name, coalescing in (("per_step", False), ("coalesce", True)):
        rep, rport, rpid = start(ctx, engine_replica_main, (coalescing, ports, stop), ports)
        children.append(rep)
        proc, port, pid = start(ctx, router_main, (f"r0=127.0.0.1:{rport}", 1, ports, stop), ports)
        children.append(proc)
        front[name] = (port, pid, rpid)
    for port, _, _ in front.values():
        await stream_burst(port, 8, 4, "warm")
    rounds = []
    names = list(front)
    for r in range(args.rounds):
        rnd, texts = {}, {}
        for name in round_order(names, r):
            port, pid, rpid = front[name]
            c0, r0 = cpu_s(pid), cpu_s(rpid)
            res = await stream_burst(port, args.streams, args.stream_tokens, f"round {r}")
            res["router_cpu_ms_per_request"] = round(1e3 * (cpu_s(pid) - c0) / args.streams, 3)
            res["replica_cpu_ms_per_request"] = round(1e3 * (cpu_s(rpid) - r0) / args.streams, 3)
            texts[name] = res.pop("texts")
            rnd[name] = res
        differ = sum(a != b for a, b in zip(texts["coalesce"], texts["per_step"]))
        assert differ == 0, f"round {r}: {differ} of {args.streams} texts differ between coalesced and per-step messages"
        rnd["ratio_router_cpu"] = round(rnd["coalesce"]["router_cpu_ms_per_request"] / rnd["per_step"]["router_cpu_ms_per_request"], 3)
        rounds.append(rnd)
    median = {n: {k: round(statistics.median(x[n][k] for x in rounds), 3) for k in rounds[0][n]} for n in names}
    median["ratio_router_cpu"] = round(statistics.median(x["ratio_router_cpu"] for x in rounds), 3)
    return {"rounds": rounds, "median": median, "texts_equal": True}


def report(args, out: dict) -> str:
    lines = ["# Router -> replica hop (issue 17)", "",
             f"`python -m bench.studies.replica_hop --parts {','.join(args.parts)} --rounds {args.rounds} --requests {args.requests} "
             f"--max-tokens {args.max_tokens} --pools {','.join(map(str, args.pools))} --streams {args.streams} "
             f"--stream-tokens {args.stream_tokens}` ({os.cpu_count()} CPUs, 1-minute load average {out['load_average_1m']} "
             "at the end); medians over interleaved rounds.", ""]
    if "channels" in out:
        lines += ["## One channel per replica vs a pool", "",
                  f"Fake replicas, {args.requests} concurrent streams x {args.max_tokens} tokens per round.", "",
                  "| channels per replica | router CPU ms / request | vs 1 channel | requests/s |", "|---|---|---|---|"]
        for name, m in out["channels"]["median"].items():
            lines.append(f"| {name.split('_')[1]} | {m['cpu_ms_per_request']} | {m['ratio_cpu_vs_pool_1']} | {m['requests_per_s']} |")
        lines.append("")
    if "coalesce" in out:
        c = out["coalesce"]["median"]
        lines += ["## Coalescing ready tokens into one message", "",
                  f"Built-in engine (tiny model, CPU), {args.streams} concurrent greedy streams x {args.stream_tokens} tokens per "
                  "round; every request's text equal in both variants.", "",
                  "| replica engine | messages / request | tokens / request | router CPU ms / request | replica CPU ms / request | "
                  "TTFT p50 ms | latency p50 ms | tokens/s |", "|---|---|---|---|---|---|---|---|"]
        for name in ("per_step", "coalesce"):
            m = c[name]
            lines.append(f"| {name} | {m['messages_per_request']} | {m['tokens_per_request']} | {m['router_cpu_ms_per_request']} | "
                         f"{m['replica_cpu_ms_per_request']} | {m['ttft_p50_ms']} | {m['latency_p50_ms']} | {m['tokens_per_s']} |")
        lines += ["", f"Router CPU, coalesce / per step: {c['ratio_router_cpu']} (median of per-round ratios)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="channels,coalesce")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pools", default="1,2,4")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "replica_hop"))
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    args.pools = [int(k) for k in args.pools.split(",")]
    if args.pools[0] != 1:
        ap.error("--pools must start with 1 (the production client, the reference)")
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    children: list[mp.Process] = []
    out: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
    try:
        if "channels" in args.parts:
            out["channels"] = asyncio.run(channels_part(args, ctx, ports, stop, children))
        if "coalesce" in args.parts:
            out["coalesce"] = asyncio.run(coalesce_part(args, ctx, ports, stop, children))
    finally:
        stop.set()
        join_children(children)
    out["load_average_1m"] = round(os.getloadavg()[0], 2)
    text = report(args, out)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
