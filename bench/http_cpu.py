"""HTTP front door CPU per request by HTTP parser and event loop, in one run.

Processes: fake replicas (``unicache.testing.fake_replica.FakeReplica``: echo, no model)
share one; each router variant has its own (round robin, no auth, no Redis; the variant
sets ``http_parser`` and ``event_loop``); this process is the client (httpx, keep-alive
connections). Each round sends the same burst of concurrent ``/v1/completions`` requests
(half streamed) through every variant, in an order that turns each round; the figure is
the router process's CPU seconds (all threads, from /proc) per request, as a ratio to the
baseline variant (uvicorn's pure-Python h11 parser on asyncio's loop) of the same round.

    .venv/bin/python -m bench.http_cpu [--requests 400] [--concurrency 50] [--max-tokens 8]
        [--rounds 3] [--out bench/results/http_cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
from pathlib import Path

from bench.router_profile import cpu_s, replicas_main

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {  # name -> (http_parser, event_loop)
    "h11+asyncio": ("h11", "asyncio"),
    "httptools+asyncio": ("httptools", "asyncio"),
    "httptools+uvloop": ("httptools", "uvloop"),
}
BASELINE = "h11+asyncio"


def router_main(spec: str, parser: str, loop_name: str, ports, stop) -> None:
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config
    from unicache.router.http_server import loop_factory

    async def run() -> None:
        cfg = build_config(env={}, overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False,
            "routing_policy": "round_robin", "replicas": spec, "http_parser": parser, "event_loop": loop_name,
        })
        app = RouterApp(cfg)
        await app.start()
        ports.put(("router", app.http_port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await app.stop()

    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        runner.run(run())


async def burst(url: str, n: int, concurrency: int, max_tokens: int) -> dict:
    """n requests, ``concurrency`` at a time (odd ones streamed); counts answers in full."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    ok = 0
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal ok
            body = {"prompt": f"request {i} " + "x" * 40, "max_tokens": max_tokens, "stream": bool(i % 2), "temperature": 0}
            async with sem:
                r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return
            if body["stream"]:
                ok += r.text.endswith("data: [DONE]\n\n")
            else:
                ok += r.json()["usage"]["completion_tokens"] == max_tokens

        await asyncio.gather(*(one(i) for i in range(n)))
    return {"ok": ok}


async def drive(args, front: dict[str, tuple[int, int]]) -> dict:
    for port, _ in front.values():  # warm up every variant
        await burst(f"http://127.0.0.1:{port}", 50, args.concurrency, args.max_tokens)
    rounds = []
    names = list(front)
    for k in range(args.rounds):
        order = names[k % len(names):] + names[: k % len(names)]
        rnd = {}
        for name in order:
            port, pid = front[name]
            c0 = cpu_s(pid)
            res = await burst(f"http://127.0.0.1:{port}", args.requests, args.concurrency, args.max_tokens)
            assert res["ok"] == args.requests, (name, res)
            rnd[name] = {"cpu_ms_per_request": round(1e3 * (cpu_s(pid) - c0) / args.requests, 3)}
        for name in names:
            rnd[name]["ratio_vs_baseline"] = round(rnd[name]["cpu_ms_per_request"] / rnd[BASELINE]["cpu_ms_per_request"], 3)
        rounds.append(rnd)
    median = {
        name: {key: round(statistics.median(r[name][key] for r in rounds), 3) for key in ("cpu_ms_per_request", "ratio_vs_baseline")}
        for name in names
    }
    return {
        "config": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                   "rounds": args.rounds, "replicas": args.replicas, "cpus": os.cpu_count(), "baseline": BASELINE},
        "rounds": rounds,
        "median": median,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "http_cpu"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    reps = ctx.Process(target=replicas_main, args=(args.replicas, ports, stop))
    reps.start()
    children = [reps]
    front: dict[str, tuple[int, int]] = {}
    try:
        _, rep_ports, _ = ports.get(timeout=60)
        spec = ",".join(f"r{i}=127.0.0.1:{p}" for i, p in enumerate(rep_ports))
        for name, (parser, loop_name) in VARIANTS.items():
            proc = ctx.Process(target=router_main, args=(spec, parser, loop_name, ports, stop))
            proc.start()
            children.append(proc)
            _, port, pid = ports.get(timeout=60)
            front[name] = (port, pid)
        result = asyncio.run(drive(args, front))
    finally:
        stop.set()
        for c in children:
            c.join(timeout=30)
            if c.is_alive():
                c.terminate()
    lines = [
        "# HTTP front door CPU per request",
        "",
        f"`python -m bench.http_cpu --requests {args.requests} --concurrency {args.concurrency} --max-tokens {args.max_tokens} "
        f"--rounds {args.rounds}` ({os.cpu_count()} CPUs; fake replicas; half the requests streamed). "
        f"Router process CPU (all threads) per request, median over rounds; ratio to {BASELINE} in the same round.",
        "",
        "| variant | CPU ms / request | ratio vs " + BASELINE + " |",
        "|---|---|---|",
    ]
    for name, m in result["median"].items():
        lines.append(f"| {name} | {m['cpu_ms_per_request']} | {m['ratio_vs_baseline']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
