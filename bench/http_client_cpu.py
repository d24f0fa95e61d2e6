"""CPU per request of the HTTP clients the router could send vLLM requests with.

One fake backend (a plain asyncio server in its own process) answers every
``POST /v1/completions`` with a streamed body of ``--events`` server-sent events in
chunked encoding, keep-alive; the benchmark process sends ``--requests`` requests with
each client in turn, ``--concurrency`` at a time, reading every body to its end, and
reports ``time.process_time()`` per request (its own CPU only: the fake server's is not
counted). Clients:

    * ``httpx``: ``AsyncClient.build_request`` + ``send(stream=True)`` + ``aiter_raw``, as
      the router used it;
    * ``aiohttp``: ``ClientSession.post`` + ``content.iter_any`` (skipped where not installed);
    * ``http_pool``: the router's own client (``unicache.router.upstream.vllm_fleet.http_pool``).

Run (from the repository root; the figures are relative, take them on an idle machine):
    .venv/bin/python -m bench.http_client_cpu [--requests 2000] [--concurrency 8] [--events 17] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

from unicache.router.upstream.vllm_fleet.http_pool import HttpPool

BODY = json.dumps({"model": "m", "prompt": "x " * 2000, "max_tokens": 16, "stream": True}).encode()


def _event(i: int) -> bytes:
    data = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": None}]})
    return f"data: {data}\n\n".encode()


def server_main(port_q, events: int) -> None:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in [_event(i) for i in range(events)] + [b"data: [DONE]\n\n"])
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(run())


async def _drive(n: int, concurrency: int, one) -> float:
    """CPU seconds per request of ``n`` calls of ``one()``, ``concurrency`` at a time."""
    await one()  # warm: a connection, imports
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    t0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - t0) / n


async def measure(port: int, n: int, concurrency: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    import httpx

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
                                 timeout=httpx.Timeout(None, connect=5.0)) as client:
        async def via_httpx() -> None:
            r = await client.send(client.build_request("POST", "/v1/completions", content=BODY,
                                                       headers={"content-type": "application/json"}), stream=True)
            async for _ in r.aiter_raw():
                pass
            await r.aclose()

        out["httpx"] = await _drive(n, concurrency, via_httpx)
    try:
        import aiohttp
    except ImportError:
        aiohttp = None
    if aiohttp is not None:
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=256)) as session:
            async def via_aiohttp() -> None:
                async with session.post("/v1/completions", data=BODY, headers={"content-type": "application/json"}) as r:
                    async for _ in r.content.iter_any():
                        pass

            out["aiohttp"] = await _drive(n, concurrency, via_aiohttp)
    pool = HttpPool(url)

    async def via_pool() -> None:
        r = await pool.request("POST", "/v1/completions", BODY)
        try:
            while await r.chunk() is not None:
                pass
        finally:
            r.close()

    out["http_pool"] = await _drive(n, concurrency, via_pool)
    pool.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--events", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=server_main, args=(q, args.events), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        rounds = [asyncio.run(measure(port, args.requests, args.concurrency)) for _ in range(args.rounds)]
    finally:
        proc.terminate()
        proc.join(10)
    print(f"client CPU ms per request ({args.requests} requests, {args.concurrency} at a time, {args.events} events each; "
          f"median of {args.rounds} rounds)")
    for name in rounds[0]:
        print(f"  {name:10s} {1000 * statistics.median(r[name] for r in rounds):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
