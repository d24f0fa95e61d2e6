"""How much of the HTTP front door's CPU is the HTTP server, measured with a C client.

Each server variant runs in its own process and is driven by nghttp2's ``h2load`` (C,
HTTP/1.1, keep-alive connections): the same streamed ``/v1/completions`` body, 8 tokens.
The figure is the server process's CPU (all threads, from /proc) per request, per round,
rounds interleaved; medians over rounds.

    * ``bare uvicorn``: uvicorn (httptools, uvloop, no access log: ``bench.http_cpu
      .serve_uvicorn``, as the bare proxy of ``bench.http_cpu``) serving an ASGI app that parses the
      body with ``json.loads`` and streams 8 fixed SSE events and ``[DONE]``: what the
      HTTP server itself costs, nothing routed;
    * ``bare granian (asgi)`` / ``bare granian (rsgi)``: the same app on granian's embedded
      server (Rust, hyper; only where ``granian`` is installed, it is not a dependency);
    * ``router``: this checkout's HTTP front door (``RouterApp``: httptools, uvloop, round
      robin, no auth, no Redis) in front of 4 fake replicas over the framed hop, which
      stream the 8 tokens.

Run (from the repository root; ``apt-get install nghttp2-client`` for h2load):
    .venv/bin/python -m bench.studies.http_floor [--requests 4000] [--rounds 3] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

from bench.http_cpu import read_asgi_body, router_main, serve_uvicorn
from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, write_report
from bench.rounds import round_order
from bench.router_profile import free_port, replica_spec, replicas_main
from unicache.testing.procfs import cpu_s

TOKENS = 8
_EVENTS = [b'data: {"id":"cmpl-bare","object":"text_completion","choices":[{"index":0,"text":"t%d",'
           b'"finish_reason":null,"logprobs":null}]}\n\n' % i for i in range(TOKENS)]


async def bare_app(scope, receive, send) -> None:
    """The bare ASGI app: every request streams ``TOKENS`` completion events and
    ``[DONE]`` (what a minimal Python server costs; ``bench.router_side_by_side``'s fake
    workers answer with it too)."""
    if scope["type"] != "http":
        return
    json.loads(await read_asgi_body(receive))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for e in _EVENTS:
        await send({"type": "http.response.body", "body": e, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _rsgi(scope, proto) -> None:
    json.loads(await proto())
    tr = proto.response_stream(200, [("content-type", "text/event-stream")])
    for e in _EVENTS:
        await tr.send_bytes(e)
    await tr.send_bytes(b"data: [DONE]\n\n")


def bare_main(kind: str, ports, stop) -> None:
    """One bare server (``kind``: uvicorn, granian-asgi, granian-rsgi) until ``stop``."""
    import asyncio

    import uvloop

    async def run() -> None:
        if kind == "uvicorn":
            server, task, port = await serve_uvicorn(bare_app)
            ports.put((kind, port, os.getpid()))
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
            server.should_exit = True
            await task
            return
        from granian.constants import Interfaces
        from granian.log import LogLevels
        from granian.server.embed import Server

        rsgi = kind == "granian-rsgi"
        port = free_port()
        server = Server(_rsgi if rsgi else bare_app, address="127.0.0.1", port=port,
                        interface=Interfaces.RSGI if rsgi else Interfaces.ASGI, log_level=LogLevels.error)
        task = asyncio.create_task(server.serve())
        await asyncio.sleep(1.0)  # NOTE: the embedded server has no started flag; h2load's warm-up checks it answers
        ports.put((kind, port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.stop()
        await task

    uvloop.run(run())


def h2load(port: int, n: int, body_path: str, concurrency: int) -> dict:
    out = subprocess.run(["h2load", "--h1", "-n", str(n), "-c", str(concurrency), "-d", body_path, "-H",
                          "content-type: application/json", f"http://127.0.0.1:{port}/v1/completions"],
                         capture_output=True, text=True, timeout=600).stdout
    line = next(x for x in out.splitlines() if x.startswith("requests:"))
    succeeded = int(line.split("succeeded")[0].split(",")[-1].strip())
    rps = float(next(x for x in out.splitlines() if "finished in" in x).split(",")[1].split()[0])
    return {"succeeded": succeeded, "requests_per_s": rps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if shutil.which("h2load") is None:
        ap.error("h2load not found (apt-get install nghttp2-client)")
    t0 = time.perf_counter()
    try:
        import granian  # noqa: F401
        kinds = ["uvicorn", "granian-asgi", "granian-rsgi"]
    except ImportError:
        kinds = ["uvicorn"]
        print("granian not installed: its variants are left out", file=sys.stderr)
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=replicas_main, args=(4, ports, stop))]
    procs[0].start()
    _, rep_ports, rep_pid = ports.get(timeout=120)
    servers: dict[str, tuple[int, int]] = {}
    for kind in kinds:
        p = ctx.Process(target=bare_main, args=(kind, ports, stop))
        p.start()
        procs.append(p)
        k, port, pid = ports.get(timeout=120)
        servers[f"bare {k}"] = (port, pid)
    p = ctx.Process(target=router_main, args=(replica_spec(rep_ports, hop=True), "httptools", "uvloop", ports, stop))
    p.start()
    procs.append(p)
    _, port, pid = ports.get(timeout=120)
    servers["router"] = (port, pid)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        body.write_text(json.dumps({"prompt": "request " + "x" * 40, "max_tokens": TOKENS, "stream": True,
                                    "temperature": 0}))
        try:
            for name, (port, _) in servers.items():
                h2load(port, 200, str(body), args.concurrency)  # warm-up
            names = list(servers)
            for i in range(args.rounds):
                order = round_order(names, i)
                row = {}
                for name in order:
                    port, pid = servers[name]
                    c0, r0 = cpu_s(pid), cpu_s(rep_pid)
                    res = h2load(port, args.requests, str(body), args.concurrency)
                    res["cpu_ms_per_request"] = round(1e3 * (cpu_s(pid) - c0) / args.requests, 4)
                    if name == "router":
                        res["replicas_cpu_ms_per_request"] = round(1e3 * (cpu_s(rep_pid) - r0) / args.requests, 4)
                    row[name] = res
                    print(f"round {i + 1}: {name}: {res}", file=sys.stderr)
                rounds.append(row)
        finally:
            stop.set()
            for p in procs:
                p.join(30)
    summary = {name: {"cpu_ms_per_request": statistics.median(r[name]["cpu_ms_per_request"] for r in rounds),
                      "requests_per_s": statistics.median(r[name]["requests_per_s"] for r in rounds),
                      "all_succeeded": all(r[name]["succeeded"] == args.requests for r in rounds)}
               for name in servers}
    load = os.getloadavg()[0]
    report = {"command": "python -m bench.studies.http_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "load_average_end": load, "requests": args.requests, "concurrency": args.concurrency,
              "summary": summary, "rounds": rounds, "wall_s": time.perf_counter() - t0}
    lines = ["# HTTP front door: the HTTP server's share of its CPU\n",
             f"Produced by `{report['command']}` at commit {report['commit']} ({report['cpus']} CPUs, 1-minute load "
             f"average {load:.1f} at the end); h2load, HTTP/1.1, {args.concurrency} connections, {args.requests} "
             f"streamed requests of {TOKENS} tokens per round, {args.rounds} rounds, medians.\n",
             "| server | CPU ms / request | requests/s | every request succeeded |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['cpu_ms_per_request']:.3f} | {s['requests_per_s']:.0f} | {s['all_succeeded']} |")
    write_report(Path(args.out_dir), "http_floor", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
