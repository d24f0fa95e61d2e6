"""The floor of a Python gRPC server (issue 17): CPU per streamed request of the two asyncio
gRPC servers Python has, each answering ``Router.Generate`` by itself, nothing routed.

Issue 17 asks for the router's CPU per request at most 0.3 ms on either front door. The
gRPC front door runs on grpc.aio (grpcio's C core); ``bench.router_side_by_side`` measured
a bare grpc.aio server streaming the same tokens at 0.273 ms per request, the door at
0.470 ms. This study asks whether the other asyncio gRPC server, grpclib (pure Python, on
the ``h2`` HTTP/2 state machine), has a lower floor a front door could be built on:

    * ``bare grpc.aio server``: ``bench.router_side_by_side.bare_grpc_server_main``;
    * ``bare grpclib server``: the same handler on grpclib (``TOKENS`` prebuilt messages
      per request), on uvloop as the other.

Each server runs in its own process; nghttp2's ``h2load`` (C) sends the same gRPC frame
(one stream at a time per connection, ``--connections`` connections); the figure is the
server process's CPU (all threads, /proc) per request, per round, rounds interleaved
(``bench.rounds.round_order``), medians over rounds. h2load counts a gRPC error as HTTP
200, so before the rounds one grpc.aio client call to each server must return all
``TOKENS`` messages with status OK.

grpclib is not a dependency of the project: ``.venv/bin/pip install grpclib`` first.

Run (from the repository root; ``apt-get install nghttp2-client`` for h2load):
    .venv/bin/python -m bench.studies.grpc_server_floor [--requests 4000] [--rounds 5]
        [--out-dir bench/results]   (writes grpc_server_floor.{json,md})
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, produced_by, write_report
from bench.rounds import round_order
from bench.router_side_by_side import bare_grpc_server_main
from bench.router_workers import grpc_frame, h2load_burst
from bench.studies.http_floor import TOKENS
from unicache.testing.procfs import cpu_s

TARGET_MS = 0.3


def bare_grpclib_server_main(ports, stop) -> None:
    """A grpclib ``Router.Generate`` answering by itself with ``TOKENS`` prebuilt messages,
    on uvloop until ``stop``; puts ("bare-grpclib-server", port, pid) to ``ports``."""
    import uvloop
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    from unicache.v1 import router_pb2

    messages = [router_pb2.RouterGenerateResponse(token_ids=[i], text=f"t{i}") for i in range(TOKENS)]

    class Router:
        async def generate(self, stream) -> None:
            await stream.recv_message()
            for m in messages:
                await stream.send_message(m)

        def __mapping__(self):
            return {"/unicache.v1.Router/Generate": Handler(
                self.generate, Cardinality.UNARY_STREAM, router_pb2.RouterGenerateRequest,
                router_pb2.RouterGenerateResponse)}

    async def run() -> None:
        server = Server([Router()])
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # NOTE: grpclib exposes no bound port
        ports.put(("bare-grpclib-server", port, os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.close()
        await server.wait_closed()

    uvloop.run(run())


async def _answers(port: int) -> tuple[int, str]:
    """One call through a grpc.aio client: (messages received, final status name)."""
    import grpc

    from unicache.v1 import common_pb2, router_pb2

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/unicache.v1.Router/Generate",
                                    request_serializer=router_pb2.RouterGenerateRequest.SerializeToString,
                                    response_deserializer=router_pb2.RouterGenerateResponse.FromString)(
            router_pb2.RouterGenerateRequest(text="hello", sampling=common_pb2.SamplingParams(max_tokens=TOKENS)))
        got = [m async for m in call]
        return len(got), (await call.code()).name


def markdown(report: dict) -> str:
    lines = ["# The floor of a Python gRPC server (issue 17)", "", produced_by(report), "",
             f"Server process CPU per streamed request ({TOKENS} messages each), h2load, {report['connections']} "
             f"connections, one stream at a time on each, {report['requests']} requests per round, "
             f"{len(report['rounds'])} rounds interleaved; median over rounds (min - max).", "",
             "| server | CPU ms per request | requests/s | over grpc.aio's (per-round median) |", "|---|---|---|---|"]
    for name, s in report["summary"].items():
        lines.append(f"| {name} | {s['cpu_ms_per_request']} ({s['cpu_min']} - {s['cpu_max']}) | {s['requests_per_s']} | "
                     f"{s['ratio_to_grpc_aio']}x |")
    lines += ["", f"Issue 17's target for the router (routing included): {TARGET_MS} ms per request.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if shutil.which("h2load") is None:
        ap.error("h2load not found (apt-get install nghttp2-client)")
    try:
        import grpclib  # noqa: F401
    except ImportError:
        ap.error("grpclib is not installed (it is no dependency of the project): .venv/bin/pip install grpclib")
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    targets = {"bare grpc.aio server": bare_grpc_server_main, "bare grpclib server": bare_grpclib_server_main}
    procs, servers = [], {}
    rounds: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        frame = Path(tmp) / "frame.bin"
        frame.write_bytes(grpc_frame(TOKENS))
        try:
            for name, target in targets.items():
                p = ctx.Process(target=target, args=(ports, stop))
                p.start()
                procs.append(p)
                _, port, pid = ports.get(timeout=120)
                servers[name] = (port, pid)
                got, code = asyncio.run(_answers(port))
                if (got, code) != (TOKENS, "OK"):
                    raise SystemExit(f"{name} answered {got} messages, status {code}")
            for name, (port, _) in servers.items():
                h2load_burst(port, 500, args.connections, str(frame), streams=1)  # warm-up
            for i in range(args.rounds):
                row = {}
                for name in round_order(list(servers), i):
                    port, pid = servers[name]
                    c0 = cpu_s(pid)
                    res = h2load_burst(port, args.requests, args.connections, str(frame), streams=1)
                    if min(res["ok"], res["status_2xx"]) != args.requests:
                        raise SystemExit(f"{name}: {res['ok']} of {args.requests} requests succeeded")
                    row[name] = {"cpu_ms_per_request": round(1e3 * (cpu_s(pid) - c0) / args.requests, 4),
                                 "requests_per_s": res["requests_per_s"]}
                    print(f"round {i + 1}/{args.rounds}: {name}: {row[name]}", file=sys.stderr, flush=True)
                rounds.append(row)
        finally:
            stop.set()
            for p in procs:
                p.join(30)
    summary = {}
    for name in servers:
        cpus = [r[name]["cpu_ms_per_request"] for r in rounds]
        summary[name] = {"cpu_ms_per_request": round(statistics.median(cpus), 3), "cpu_min": round(min(cpus), 3),
                         "cpu_max": round(max(cpus), 3),
                         "requests_per_s": round(statistics.median(r[name]["requests_per_s"] for r in rounds)),
                         "ratio_to_grpc_aio": round(statistics.median(
                             r[name]["cpu_ms_per_request"] / r["bare grpc.aio server"]["cpu_ms_per_request"] for r in rounds), 2)}
    report = {"command": "python -m bench.studies.grpc_server_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "requests": args.requests, "connections": args.connections, "rounds": rounds, "summary": summary,
              "wall_s": time.perf_counter() - t0}
    write_report(Path(args.out_dir), "grpc_server_floor", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
