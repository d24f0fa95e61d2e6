"""HTTP front door CPU per request by HTTP parser and event loop, in one run, against a
bare HTTP proxy (the floor) and another checkout's router (A/B).

Processes: fake replicas (``unicache.testing.fake_replica.FakeReplica``: echo, no model)
share one; each router variant has its own (round robin, no auth, no Redis; the variant
sets ``http_parser`` and ``event_loop``); this process is the client (httpx, keep-alive
connections). Each round sends the same burst of concurrent ``/v1/completions`` requests
(half streamed) through every front door, in an order that turns each round; the figure
is each front door process's CPU seconds (all threads, from /proc) per request, as a
ratio to the reference variant (the first of ``--variants``) of the same round.

``--bare``: also a bare HTTP proxy per event loop in the variants (uvicorn with httptools,
a raw ASGI app: the body parsed with ``json.loads``, the prompt's UTF-8 bytes forwarded to
a replica over grpc.aio, each replica message one SSE event or the texts collected into
one JSON body; no auth, validation, hashing, classification, metrics or Starlette): what
any Python router on uvicorn and grpc.aio pays. ``--baseline-unicache EXE``: also ``EXE
router`` (another checkout's ``unicache`` command, e.g. a ``git worktree`` of an older
commit with its own venv) with httptools on each event loop in the variants;
``--tree-unicache EXE`` the same for this checkout's command, so both trees run alike. Per round,
each variant's CPU is also given as a ratio to the bare proxy and to the baseline on the
same loop. ``--profile``: the first variant's router runs under cProfile (its event-loop
thread, every burst; slows it, so its figures mean less) and the top functions are printed.

    .venv/bin/python -m bench.http_cpu [--requests 400] [--concurrency 50] [--max-tokens 8]
        [--rounds 3] [--variants h11+asyncio,httptools+asyncio,httptools+uvloop] [--bare]
        [--baseline-unicache EXE] [--profile] [--out bench/results/http_cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.load_test import join_children
from bench.rounds import round_order
from bench.router_profile import cpu_s, profile_report, replica_spec, replicas_main, start_baseline

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {  # name -> (http_parser, event_loop)
    "h11+asyncio": ("h11", "asyncio"),
    "httptools+asyncio": ("httptools", "asyncio"),
    "httptools+uvloop": ("httptools", "uvloop"),
}


def router_main(spec: str, parser: str, loop_name: str, ports, stop, profile_path: str | None = None,
                policy: str = "round_robin", grpc_port_too: bool = False) -> None:
    """The router (``RouterApp``, no auth, no Redis) until ``stop``; puts ("router", HTTP
    port, pid) to ``ports`` and, with ``grpc_port_too``, then ("router-grpc", gRPC port, pid)."""
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config
    from unicache.router.frontends.http_server import loop_factory

    async def run() -> None:
        import cProfile

        cfg = build_config(env={}, overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False,
            "routing_policy": policy, "replicas": spec, "http_parser": parser, "event_loop": loop_name,
        })
        app = RouterApp(cfg)
        await app.start()
        prof = cProfile.Profile() if profile_path else None
        if prof is not None:
            prof.enable()
        ports.put(("router", app.http_port, os.getpid()))
        if grpc_port_too:
            ports.put(("router-grpc", app.grpc_port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile_path)
        await app.stop()

    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        runner.run(run())


def bare_app(addresses: list[str], metadata=None):
    """The bare proxy's ASGI app (see the module docstring) and its channels; ``metadata``:
    a function giving what each replica call carries (e.g. the cluster credential's)."""
    import itertools

    import grpc

    from unicache.v1 import common_pb2, replica_pb2

    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    calls = itertools.cycle([
        c.unary_stream("/unicache.v1.Replica/Generate", request_serializer=replica_pb2.GenerateRequest.SerializeToString,
                       response_deserializer=replica_pb2.GenerateResponse.FromString)
        for c in channels
    ])

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = json.loads(await read_asgi_body(receive))
        request = replica_pb2.GenerateRequest(
            token_ids=replica_pb2.TokenIds(ids=body["prompt"].encode()),
            sampling=common_pb2.SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 1.0)),
        )
        head = {"id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "bare"}
        stream = bool(body.get("stream"))
        kind = b"text/event-stream" if stream else b"application/json"
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
            async for msg in next(calls)(request, timeout=300, metadata=metadata() if metadata else None):
                event = {**head, "choices": [{"index": msg.index, "text": msg.text, "finish_reason": None, "logprobs": None}]}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        texts, tokens = [], 0
        async for msg in next(calls)(request, timeout=300, metadata=metadata() if metadata else None):
            texts.append(msg.text)
            tokens += len(msg.token_ids)
        out = json.dumps({**head, "choices": [{"index": 0, "text": "".join(texts), "finish_reason": "length", "logprobs": None}],
                          "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    return app, channels


async def read_asgi_body(receive) -> bytes:
    """An ASGI HTTP request's whole body."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def serve_uvicorn(app):
    """``app`` served by uvicorn (httptools, no access log, no lifespan) on a free port of
    127.0.0.1 on the running loop, once it accepts; returns (server, serving task, port).
    Stop it with ``server.should_exit = True`` and await the task."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", log_level="warning", lifespan="off", access_log=False))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def start_bare_http(addresses: list[str], metadata=None):
    """The bare proxy (``bare_app``) served by uvicorn (``serve_uvicorn``); returns (server,
    serving task, port, channels)."""
    app, channels = bare_app(addresses, metadata)
    server, task, port = await serve_uvicorn(app)
    return server, task, port, channels


async def stop_bare_http(server, task, channels) -> None:
    server.should_exit = True
    await task
    for c in channels:
        await c.close()


def bare_main(spec: str, loop_name: str, ports, stop) -> None:
    from unicache.router.frontends.http_server import loop_factory

    async def run() -> None:
        server, task, port, channels = await start_bare_http([a.split("=", 1)[1] for a in spec.split(",")])
        ports.put(("router", port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await stop_bare_http(server, task, channels)

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


def references(name: str, names: list[str]) -> dict[str, str]:
    """The per-round references of front door ``name``: the bare proxy and the baseline
    checkout on its event loop (those present)."""
    if name.startswith(("bare:", "baseline:")):  # "tree:..." (this checkout's command) has both references
        return {}
    loop = name.split("+")[-1]
    return {key: ref for key, ref in (("bare", f"bare:{loop}"), ("baseline_tree", f"baseline:httptools+{loop}")) if ref in names}


async def drive(args, front: dict[str, tuple[int, int]], reference: str) -> dict:
    for port, _ in front.values():  # warm up every front door
        await burst(f"http://127.0.0.1:{port}", 50, args.concurrency, args.max_tokens)
    rounds = []
    names = list(front)
    for k in range(args.rounds):
        order = round_order(names, k)
        rnd = {}
        for name in order:
            port, pid = front[name]
            c0 = cpu_s(pid)
            res = await burst(f"http://127.0.0.1:{port}", args.requests, args.concurrency, args.max_tokens)
            assert res["ok"] == args.requests, (name, res)
            rnd[name] = {"cpu_ms_per_request": round(1e3 * (cpu_s(pid) - c0) / args.requests, 3)}
        for name in names:
            rnd[name]["ratio_vs_baseline"] = round(rnd[name]["cpu_ms_per_request"] / rnd[reference]["cpu_ms_per_request"], 3)
            for key, ref in references(name, names).items():
                rnd[name][f"ratio_vs_{key}"] = round(rnd[name]["cpu_ms_per_request"] / rnd[ref]["cpu_ms_per_request"], 3)
        rounds.append(rnd)
    median = {
        name: {key: round(statistics.median(r[name][key] for r in rounds), 3) for key in rounds[0][name]}
        for name in names
    }
    return {
        "config": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                   "replica_transport": args.replica_transport,
                   "rounds": args.rounds, "replicas": args.replicas, "cpus": os.cpu_count(), "baseline": reference,
                   "baseline_unicache": args.baseline_unicache, "load_average_1m": round(os.getloadavg()[0], 2)},
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
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}; "
                    "the first is the reference of every ratio_vs_baseline")
    ap.add_argument("--bare", action="store_true", help="also a bare HTTP proxy on each event loop of the variants")
    ap.add_argument("--baseline-unicache", metavar="EXE", help="also `EXE router` (another checkout) on each event loop")
    ap.add_argument("--tree-unicache", metavar="EXE", help="also `EXE router` (this checkout's command: run as the baseline "
                    "is, a process of its own) on each event loop")
    ap.add_argument("--profile", action="store_true", help="the first variant under cProfile")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--replica-transport", choices=("hop", "grpc"), default="hop",
                    help="the in-process routers' replica hop: the framed hop (production's default) or gRPC; "
                         "--baseline-unicache/--tree-unicache routers and the bare proxy always use gRPC")
    ap.add_argument("--out", default=str(RESULTS / "http_cpu"))
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown} (choose from {', '.join(VARIANTS)})")
    loops = list(dict.fromkeys(VARIANTS[v][1] for v in variants))
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    prof_path = os.path.join(tempfile.mkdtemp(), "router.prof") if args.profile else None
    reps = ctx.Process(target=replicas_main, args=(args.replicas, ports, stop))
    reps.start()
    children = [reps]
    baselines: list[subprocess.Popen] = []
    front: dict[str, tuple[int, int]] = {}
    try:
        _, rep_ports, _ = ports.get(timeout=60)
        spec = replica_spec(rep_ports)  # gRPC: the bare proxy's hop, and older checkouts' spec
        tree_spec = replica_spec(rep_ports, hop=args.replica_transport == "hop")
        procs = [(name, router_main, (tree_spec, *VARIANTS[name], ports, stop, prof_path if i == 0 else None))
                 for i, name in enumerate(variants)]
        if args.bare:
            procs += [(f"bare:{loop}", bare_main, (spec, loop, ports, stop)) for loop in loops]
        for name, target, targs in procs:
            proc = ctx.Process(target=target, args=targs)
            proc.start()
            children.append(proc)
            _, port, pid = ports.get(timeout=60)
            front[name] = (port, pid)
        for label, exe in (("baseline", args.baseline_unicache), ("tree", args.tree_unicache)):
            for loop in loops if exe else ():
                proc, _, http_port = start_baseline(exe, spec, extra_env={"UNICACHE_HTTP_PARSER": "httptools", "UNICACHE_EVENT_LOOP": loop})
                baselines.append(proc)
                front[f"{label}:httptools+{loop}"] = (http_port, proc.pid)
        result = asyncio.run(drive(args, front, variants[0]))
    finally:
        stop.set()
        for proc in baselines:
            proc.terminate()
            proc.wait(timeout=30)
        join_children(children)
    reference = variants[0]
    extra = [k for k in ("ratio_vs_bare", "ratio_vs_baseline_tree") if any(k in m for m in result["median"].values())]
    lines = [
        "# HTTP front door CPU per request",
        "",
        f"`python -m bench.http_cpu --requests {args.requests} --concurrency {args.concurrency} --max-tokens {args.max_tokens} "
        f"--rounds {args.rounds} --variants {args.variants} --replica-transport {args.replica_transport}{' --bare' * args.bare}"
        f"{' --baseline-unicache EXE' if args.baseline_unicache else ''}{' --tree-unicache EXE' if args.tree_unicache else ''}` ({os.cpu_count()} CPUs, 1-minute load average "
        f"{result['config']['load_average_1m']} at the end; fake replicas; half the requests streamed). "
        f"Front door process CPU (all threads) per request, median over rounds of the per-round figures; ratio to "
        f"{reference} in the same round" + (" and to the bare proxy / the baseline checkout on the same event loop" if extra else "")
        + (f"; baseline: `{args.baseline_unicache}`" if args.baseline_unicache else "") + ".",
        "",
        "| front door | CPU ms / request | ratio vs " + reference + " |" + "".join(f" {k.replace('_', ' ')} |" for k in extra),
        "|---|---|---|" + "---|" * len(extra),
    ]
    for name, m in result["median"].items():
        lines.append(f"| {name} | {m['cpu_ms_per_request']} | {m['ratio_vs_baseline']} |"
                     + "".join(f" {m.get(k, '')} |" for k in extra))
    text = "\n".join(lines) + "\n"
    print(text)
    if prof_path:
        print(profile_report(prof_path, args.top))
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
