"""This router's HTTP front door beside the Rust routers, on one machine, in one run (issue 17).

Every server runs in its own process and nghttp2's ``h2load`` (C, HTTP/1.1, keep-alive
connections) sends the same streamed ``/v1/completions`` body; the figure is the server
process's CPU (all threads, from /proc) per request, per round, rounds interleaved
(``bench.rounds.round_order``), medians over rounds:

    * ``unicache``: this checkout's HTTP front door (``RouterApp``: httptools, uvloop, no
      auth, no Redis; routing policy ``--policy``, default ``cache_aware``) in front of 4
      fake replicas over the framed hop (one process, ``bench.router_profile.replicas_main``);
    * ``sglang-router`` / ``vllm-router`` (where their commands are found: ``--rust-bin``,
      else ``PATH``; neither is a dependency of this project, install them in a venv of
      their own): the router with ``--policy cache_aware`` in front of 4 fake OpenAI
      workers (one process, uvicorn: ``worker_app`` answers the routers' health and info
      probes and streams the tokens);
    * ``bare uvicorn``: uvicorn serving an app that parses the body and streams the same
      events (``bench.bare_http``): the floor of a Python HTTP server, nothing
      routed;
    * ``unicache (gRPC)``: the same router process's gRPC front door, ``Router.Generate``
      sent by h2load over HTTP/2 with gRPC framing (one stream at a time per connection,
      as the HTTP rows); ``bare grpc.aio proxy``: a grpc.aio ``Router.Generate`` that only
      forwards to the fake replicas' gRPC ports (``bench.router_profile.start_bare_proxy``,
      uvloop); ``bare grpc.aio server``: a grpc.aio ``Router.Generate`` streaming the
      tokens itself (the floor of grpc.aio, nothing routed). h2load counts a gRPC error as
      HTTP 200, so the rows behind the fake replicas succeed only when those answered as
      many streams as were sent.

Latency (``--latency-requests``): the same request sent one at a time on one connection,
p50 / p99 of the time to the end of each response (h2load's per-request log), and each
server's p50 over the bare server's of its protocol in the same round (bare uvicorn, or
the bare grpc.aio server for the gRPC rows: what routing through it adds over a minimal
Python server answering by itself; the Rust routers' fake workers are bare uvicorn's app,
this router's fake replicas answer over the hop).

Every backend streams ``TOKENS`` events at once (the cheapest backend: the router's own
cost is what is left). The Rust routers try to fetch a tokenizer for the fake model name
at start and go on without one (their cache-aware policies match on text).

Run (from the repository root; ``apt-get install nghttp2-client`` for h2load; the Rust
routers: ``python3 -m venv /tmp/rr && /tmp/rr/bin/pip install sglang-router==0.3.2
vllm-router==0.1.17``):
    .venv/bin/python -m bench.router_side_by_side [--rust-bin /tmp/rr/bin] [--requests 4000]
        [--rounds 5] [--out-dir bench/results] [--json OUT]   (writes router_side_by_side.{json,md,png})
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from unicache.contract.model_name import DEFAULT_MODEL_NAME
from unicache.sim.metrics import percentile
from unicache.testing.procfs import cpu_s
from bench.bare_http import TOKENS, bare_app, bare_main, h2load
from bench.http_cpu import read_asgi_body, router_main, serve_uvicorn
from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, save_figure, write_report
from bench.rounds import round_order
from bench.router_profile import free_port, replica_spec, replicas_main, start_bare_proxy
from bench.router_workers import grpc_frame, h2load_burst

WORKERS = 4
MODEL = DEFAULT_MODEL_NAME
_INFO = json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True, "object": "list",
                    "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}).encode()


async def worker_app(scope, receive, send) -> None:
    """A fake OpenAI worker: POST ``/v1/completions`` is bare uvicorn's app (streams
    ``TOKENS`` events and ``[DONE]``); any other path (the routers' health and model-info
    probes) answers one JSON body with what they read."""
    if scope["type"] != "http":
        return
    if scope["method"] == "POST" and scope["path"] == "/v1/completions":
        await bare_app(scope, receive, send)
        return
    await read_asgi_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _INFO})


def workers_main(n: int, ports, stop) -> None:
    """``n`` fake OpenAI workers (``worker_app``) on one uvloop until ``stop`` is set; their
    ports go to ``ports``."""
    import uvloop

    async def run() -> None:
        served = [await serve_uvicorn(worker_app) for _ in range(n)]
        ports.put(("workers", [p for _, _, p in served], os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for server, _, _ in served:
            server.should_exit = True
        await asyncio.gather(*(task for _, task, _ in served))

    uvloop.run(run())


def bare_grpc_main(addresses: list[str], ports, stop) -> None:
    """The bare grpc.aio proxy (``start_bare_proxy``) on uvloop until ``stop``; puts
    ("bare-grpc", port, pid) to ``ports``."""
    import uvloop

    async def run() -> None:
        server, port, channels = await start_bare_proxy(addresses)
        ports.put(("bare-grpc", port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(0)
        for c in channels:
            await c.close()

    uvloop.run(run())


def bare_grpc_server_main(ports, stop) -> None:
    """A grpc.aio ``Router.Generate`` that answers by itself, streaming ``TOKENS`` prebuilt
    messages (the gRPC analogue of bare uvicorn: what grpc.aio costs, nothing routed), on
    uvloop until ``stop``; puts ("bare-grpc-server", port, pid) to ``ports``."""
    import grpc
    import uvloop

    from unicache.v1 import router_pb2

    messages = [router_pb2.RouterGenerateResponse(token_ids=[i], text=f"t{i}").SerializeToString() for i in range(TOKENS)]

    async def generate(request, context):
        for m in messages:
            yield m

    async def run() -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=router_pb2.RouterGenerateRequest.FromString, response_serializer=None)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("unicache.v1.Router", {"Generate": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(("bare-grpc-server", port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(0)

    uvloop.run(run())


def rust_command(name: str, exe: str, port: int, worker_ports: list[int]) -> list[str]:
    """The command line that starts Rust router ``name`` on ``port`` with cache-aware routing."""
    urls = [f"http://127.0.0.1:{p}" for p in worker_ports]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
              "--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [exe, "launch", *common, "--log-level", "error"]
    return [exe, *common, "--log-level", "error"]


def latency_ms(port: int, n: int, payload: str, grpc: bool) -> dict:
    """``n`` requests one at a time on one connection (h2load ``-c 1``; ``grpc``: HTTP/2
    with gRPC framing to ``Router.Generate``, else HTTP/1.1 ``/v1/completions``): p50 and
    p99 of each request's time to the end of its response, from h2load's per-request log,
    in ms, and how many failed."""
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        cmd = ["h2load", "-n", str(n), "-c", "1", "-m", "1", "-d", payload, "--log-file", log.name]
        if grpc:
            cmd += ["-H", "content-type: application/grpc", "-H", "te: trailers",
                    f"http://127.0.0.1:{port}/unicache.v1.Router/Generate"]
        else:
            cmd += ["--h1", "-H", "content-type: application/json", f"http://127.0.0.1:{port}/v1/completions"]
        subprocess.run(cmd, capture_output=True, check=True, timeout=600)
        rows = [line.split("\t") for line in Path(log.name).read_text().splitlines() if line.strip()]
    ok = sorted(int(r[2]) / 1e3 for r in rows if r[1] == "200")
    if not ok:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "failed": n}
    return {"p50_ms": round(percentile(ok, 50), 3), "p99_ms": round(percentile(ok, 99), 3), "failed": n - len(ok)}


def wait_ready(port: int, body: bytes, timeout_s: float = 90.0) -> None:
    """Until a streamed completion through ``port`` answers 200 (RuntimeError past the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and b"[DONE]" in resp.read():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answered on port {port} within {timeout_s:.0f} s")
        time.sleep(0.5)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["summary"])
    cpu = [report["summary"][n]["cpu_ms_per_request"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.barh(names, cpu, color=["tab:blue" if n.startswith("unicache") else "tab:gray" for n in names])
    ax.bar_label(bars, fmt="%.3f ms", padding=3)
    ax.set_xlabel("server CPU per streamed request, ms (median over rounds)")
    ax.set_title(f"h2load, {report['concurrency']} connections, {TOKENS}-token streams, commit {report['commit']}",
                 fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(cpu) * 1.25)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency-requests", type=int, default=1000,
                    help="requests sent one at a time per server and round for the latency figures (0: none)")
    ap.add_argument("--policy", default="cache_aware", help="this router's routing policy (default cache_aware)")
    ap.add_argument("--rust-bin", default=None, help="folder holding sglang-router / vllm-router (default: PATH)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--json", default=None, help="also write the report's JSON here (for bench.ab_commits)")
    args = ap.parse_args(argv)
    if shutil.which("h2load") is None:
        ap.error("h2load not found (apt-get install nghttp2-client)")
    rust = {name: exe for name in ("sglang-router", "vllm-router") if (exe := shutil.which(name, path=args.rust_bin))}
    for name in {"sglang-router", "vllm-router"} - set(rust):
        print(f"{name} not found: left out of this run", file=sys.stderr)
    t0 = time.perf_counter()
    body_obj = {"model": MODEL, "prompt": "request " + "x" * 40, "max_tokens": TOKENS, "stream": True,
                "temperature": 0}
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    served = ctx.Value("q", 0)  # streams the fake replicas answered
    procs = [ctx.Process(target=replicas_main, args=(WORKERS, ports, stop, served)),
             ctx.Process(target=workers_main, args=(WORKERS, ports, stop))]
    rust_procs: list[subprocess.Popen] = []
    servers: dict[str, tuple[int, int]] = {}
    grpc_servers: set[str] = set()  # the rows sent over gRPC
    backend: dict[str, int] = {}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        body.write_text(json.dumps(body_obj))
        frame = Path(tmp) / "frame.bin"
        frame.write_bytes(grpc_frame(TOKENS))
        try:
            for p in procs:
                p.start()
            started = {kind: (value, pid) for kind, value, pid in (ports.get(timeout=120) for _ in procs)}
            (rep_ports, rep_pid), (worker_ports, worker_pid) = started["replicas"], started["workers"]

            def spawn(target, *a) -> tuple[int, int]:
                """Start ``target(*a, ports, stop)`` in a process; its (port, pid) message."""
                p = ctx.Process(target=target, args=(*a, ports, stop))
                p.start()
                procs.append(p)
                _, port, pid = ports.get(timeout=120)
                return port, pid

            p = ctx.Process(target=router_main, args=(replica_spec(rep_ports, hop=True), "httptools", "uvloop", ports,
                                                      stop, None, args.policy, True))
            p.start()
            procs.append(p)
            _, port, pid = ports.get(timeout=120)
            _, gport, _ = ports.get(timeout=120)
            servers["unicache"], backend["unicache"] = (port, pid), rep_pid
            servers["unicache (gRPC)"], backend["unicache (gRPC)"] = (gport, pid), rep_pid
            servers["bare grpc.aio proxy"] = spawn(bare_grpc_main, [f"127.0.0.1:{g}" for g, _ in rep_ports])
            backend["bare grpc.aio proxy"] = rep_pid
            servers["bare grpc.aio server"] = spawn(bare_grpc_server_main)
            grpc_servers.update({"unicache (gRPC)", "bare grpc.aio proxy", "bare grpc.aio server"})
            for name, exe in rust.items():
                port = free_port()
                rp = subprocess.Popen(rust_command(name, exe, port, worker_ports), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, cwd=tmp)
                rust_procs.append(rp)
                wait_ready(port, body.read_bytes())
                servers[name], backend[name] = (port, rp.pid), worker_pid
            servers["bare uvicorn"] = spawn(bare_main, "uvicorn")

            def send(name: str, port: int, n: int) -> dict:
                """``n`` requests to server ``name``; ``succeeded`` counts only what its
                backend answered too, where that is known (the fake replicas)."""
                s0 = served.value
                if name in grpc_servers:
                    res = h2load_burst(port, n, args.concurrency, str(frame), streams=1)
                    res = {"succeeded": min(res["ok"], res["status_2xx"]), "requests_per_s": res["requests_per_s"]}
                else:
                    res = h2load(port, n, str(body), args.concurrency)
                if backend.get(name) == rep_pid:
                    res["succeeded"] = min(res["succeeded"], served.value - s0)
                return res

            for name, (port, _) in servers.items():
                send(name, port, 500)  # warm-up
            names = list(servers)
            for i in range(args.rounds):
                row = {}
                for name in round_order(names, i):
                    port, pid = servers[name]
                    b = backend.get(name)
                    c0, b0 = cpu_s(pid), (cpu_s(b) if b else 0.0)
                    res = send(name, port, args.requests)
                    res["cpu_ms_per_request"] = round(1e3 * (cpu_s(pid) - c0) / args.requests, 4)
                    if b:
                        res["backend_cpu_ms_per_request"] = round(1e3 * (cpu_s(b) - b0) / args.requests, 4)
                    if args.latency_requests:
                        grpc = name in grpc_servers
                        res["latency"] = latency_ms(port, args.latency_requests, str(frame if grpc else body), grpc)
                    row[name] = res
                    print(f"round {i + 1}/{args.rounds}: {name}: {res}", file=sys.stderr, flush=True)
                rounds.append(row)
        finally:
            stop.set()
            for rp in rust_procs:
                rp.terminate()
                rp.wait(30)
            for p in procs:
                p.join(30)
    summary = {}
    for name in servers:
        s = {"cpu_ms_per_request": statistics.median(r[name]["cpu_ms_per_request"] for r in rounds),
             "cpu_ms_range": [min(r[name]["cpu_ms_per_request"] for r in rounds),
                              max(r[name]["cpu_ms_per_request"] for r in rounds)],
             "requests_per_s": statistics.median(r[name]["requests_per_s"] for r in rounds),
             "all_succeeded": all(r[name]["succeeded"] == args.requests for r in rounds)}
        ref = "unicache (gRPC)" if name in grpc_servers else "unicache"
        # this router's CPU over this server's, per round, then the median (the machine's
        # drift cancels within a round); gRPC rows against this router's gRPC door
        s["unicache_over_this"] = round(statistics.median(
            r[ref]["cpu_ms_per_request"] / r[name]["cpu_ms_per_request"] for r in rounds), 3)
        if args.latency_requests:
            for q in ("p50_ms", "p99_ms"):
                s[f"latency_{q}"] = statistics.median(r[name]["latency"][q] for r in rounds)
            s["latency_failed"] = sum(r[name]["latency"]["failed"] for r in rounds)
            s["all_succeeded"] = s["all_succeeded"] and not s["latency_failed"]
            # the latency this server adds over a bare server of its protocol answering
            # the same request itself (bare uvicorn: the Rust routers' workers are that
            # app; gRPC rows: the bare grpc.aio server), per round, then the median
            floor = "bare grpc.aio server" if name in grpc_servers else "bare uvicorn"
            s["added_p50_ms_over_bare_server"] = round(statistics.median(
                r[name]["latency"]["p50_ms"] - r[floor]["latency"]["p50_ms"] for r in rounds), 3)
        summary[name] = s
    load = os.getloadavg()[0]
    report = {"command": "python -m bench.router_side_by_side " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "load_average_end": load, "requests": args.requests, "concurrency": args.concurrency,
              "policy": args.policy, "rust_routers": rust, "summary": summary, "rounds": rounds,
              "wall_s": round(time.perf_counter() - t0, 1)}
    lines = ["# This router beside the Rust routers: CPU per streamed request\n",
             f"Produced by `{report['command']}` at commit {report['commit']} ({report['cpus']} CPUs, 1-minute load "
             f"average {load:.1f} at the end); h2load, HTTP/1.1 (gRPC rows: HTTP/2, one stream per connection at "
             f"a time), {args.concurrency} connections, {args.requests} "
             f"streamed requests of {TOKENS} tokens per round, {args.rounds} rounds interleaved, medians. This "
             f"router: policy {args.policy}, 4 fake replicas over the framed hop; the Rust routers: cache_aware, "
             "4 fake OpenAI workers.\n",
             "| server | CPU ms / request (median, range) | unicache / this (per-round median; gRPC rows: its gRPC door) | requests/s "
             "| backend CPU ms / request | every request succeeded |", "|---|---|---|---|---|---|"]
    if args.latency_requests:
        lines[-2] = lines[-2].replace(" | every request succeeded |", " | latency p50 / p99 ms, one at a time "
                                      "| added p50 ms over the bare server (gRPC rows: grpc.aio's) | every request succeeded |")
        lines[-1] = "|---|---|---|---|---|---|---|---|"
    for name, s in summary.items():
        bcpu = statistics.median(r[name]["backend_cpu_ms_per_request"] for r in rounds) if name in backend else None
        lat = (f"| {s['latency_p50_ms']:.3f} / {s['latency_p99_ms']:.3f} | {s['added_p50_ms_over_bare_server']:+.3f} "
               if args.latency_requests else "")
        lines.append(f"| {name} | {s['cpu_ms_per_request']:.3f} ({s['cpu_ms_range'][0]:.3f}-{s['cpu_ms_range'][1]:.3f}) "
                     f"| {s['unicache_over_this']:.2f}x | {s['requests_per_s']:.0f} "
                     f"| {'-' if bcpu is None else f'{bcpu:.3f}'} {lat}| {s['all_succeeded']} |")
    write_report(Path(args.out_dir), "router_side_by_side", report, "\n".join(lines) + "\n", plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(s["all_succeeded"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
