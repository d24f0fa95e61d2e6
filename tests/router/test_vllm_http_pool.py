"""The router's HTTP/1.1 client of vLLM backends (router/upstream/vllm_fleet/http_pool.py):
keep-alive reuse, chunked bodies as they arrive, an early close closing the connection,
the stale idle connection sent again once, and failures that say whether anything was sent."""

from __future__ import annotations

import asyncio
import socket

import pytest

from unicache.router.upstream.vllm_fleet.http_pool import HttpError, HttpPool


class Backend:
    """A loopback HTTP/1.1 server with a scripted answer per request; counts connections
    and records each request's head and body."""

    def __init__(self, answer):
        self.answer = answer  # async (request_no, writer) -> bool: keep the connection
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                self.requests.append((head, await reader.readexactly(length)))
                if not await self.answer(len(self.requests), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def stop(self) -> None:
        self.server.close()
        for w in self.writers:
            w.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def sse(n, writer) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    writer.write(chunked(b"data: a\n\n", b"data: [DONE]\n\n"))
    await writer.drain()
    return True


async def test_a_connection_is_reused_and_a_chunked_body_arrives_decoded():
    backend = Backend(sse)
    pool = HttpPool(await backend.start())
    try:
        for _ in range(3):
            r = await pool.request("POST", "/v1/completions", b'{"x":1}')
            assert (r.status, r.headers["content-type"]) == (200, "text/event-stream")
            assert await r.read() == b"data: a\n\ndata: [DONE]\n\n"
            r.close()
        assert backend.connections == 1
        head, body = backend.requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:") and body == b'{"x":1}'
        assert b"Content-Length: 7\r\n" in head and b"Content-Type: application/json\r\n" in head
    finally:
        pool.close()
        await backend.stop()


async def test_closing_an_unfinished_response_closes_its_connection():
    gone = asyncio.Event()

    async def endless(n, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (9, b"data: a\n\n"))
        await writer.drain()
        try:
            while True:  # until the client hangs up
                await asyncio.sleep(0.01)
                writer.write(b"9\r\ndata: b\n\n\r\n")
                await writer.drain()
        except ConnectionError:
            gone.set()
            return False

    backend = Backend(endless)
    pool = HttpPool(await backend.start())
    try:
        r = await pool.request("POST", "/v1/completions", b"{}")
        assert (await r.chunk()).startswith(b"data: a\n\n")
        r.close()
        await asyncio.wait_for(gone.wait(), 5)
        assert pool._idle == []
    finally:
        pool.close()
        await backend.stop()


async def test_a_request_on_a_kept_connection_the_backend_dropped_is_sent_again_once():
    async def drops_the_second(n, writer) -> bool:
        if n == 2:
            return False  # closes the kept connection without a byte of answer (an idle timeout's race)
        return await sse(n, writer)

    backend = Backend(drops_the_second)
    pool = HttpPool(await backend.start())
    try:
        for _ in range(2):
            r = await pool.request("POST", "/p", b"{}")
            assert await r.read() == b"data: a\n\ndata: [DONE]\n\n"
            r.close()
        assert backend.connections == 2 and len(backend.requests) == 3
    finally:
        pool.close()
        await backend.stop()


async def test_failures_say_whether_the_request_was_sent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HttpError) as info:
        await HttpPool(f"http://127.0.0.1:{port}").request("POST", "/p", b"{}")
    assert not info.value.sent and "cannot connect" in str(info.value)

    async def dies(n, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        return False  # closed mid-body

    backend = Backend(dies)
    pool = HttpPool(await backend.start())
    try:
        r = await pool.request("POST", "/p", b"{}")
        assert await r.chunk() == b"hello"
        with pytest.raises(HttpError) as info:
            await r.chunk()
        assert info.value.sent
        r.close()
    finally:
        pool.close()
        await backend.stop()
