"""A bare streaming HTTP server and nghttp2's ``h2load`` driver: the floors the HTTP
benchmarks (``bench.http_door_cpu``, ``bench.router_side_by_side``) measure the router
against.

``bare_app`` parses the body with ``json.loads`` and streams ``TOKENS`` fixed SSE events
and ``[DONE]``: what a minimal Python HTTP server costs, nothing routed. ``bare_main``
serves it on uvicorn (httptools, uvloop) or, where ``granian`` is installed (not a
dependency), on granian's embedded server. ``h2load`` needs ``apt-get install
nghttp2-client``.
"""

from __future__ import annotations

import json
import os
import subprocess

from bench.http_cpu import read_asgi_body, serve_uvicorn
from bench.router_profile import free_port

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
