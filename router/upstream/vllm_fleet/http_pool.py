"""The router's HTTP/1.1 client of vLLM backends: keep-alive connections pooled per
backend, responses parsed by httptools and handed on as the bytes arrive.

Why not httpx: a profile of the router in front of two vLLM servers put a third of its
CPU in httpx, httpcore and anyio (request building, header lookups, pool bookkeeping).
Here a request is one ``transport.write`` of its head and body, and a response is a
status, its headers and a queue of body chunks filled by ``data_received``
(``bench/http_client_cpu.py`` compares the clients).

Invariants:
    * A connection goes back to its pool only after its response was read to the end
      and both sides keep it alive; a response closed early closes its connection, which
      vLLM sees as the client going away (it aborts the request and frees its blocks).
    * A request sent on a reused connection that ends before any byte of the answer (the
      backend closed the idle connection as the request went out) is sent once more on a
      new connection; every other failure raises ``HttpError``.
    * Body chunks wait in their response until read; past ``_HIGH_WATER`` bytes the
      connection stops reading (TCP pushes back on the backend) until the reader catches up.
    * No call waits unbounded: the connect has ``connect_timeout_s``, everything else the
      caller's deadline (``asyncio.timeout``).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024


class HttpError(Exception):
    """The connection failed or was lost; ``sent``: the request may have reached the backend
    (False: nothing connected, the backend did no work)."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class HttpResponse:
    """One response: ``status`` and ``headers`` (lower-case names) once ``request`` returns,
    then the body by ``chunk()`` (None at its end) or ``read()``; ``close()`` it in a finally."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_size", "_waiter", "_done", "_error")

    def __init__(self, conn: _Connection):
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._waiter: asyncio.Future | None = None
        self._done = False  # the body was received whole
        self._error: HttpError | None = None

    async def chunk(self) -> bytes | None:
        """The body bytes received since the last call (waiting for some), None at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                self._release()
                return None
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        if self._size > _HIGH_WATER and self._conn is not None:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while (data := await self.chunk()) is not None:
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Done with it: an unfinished response closes its connection."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self._done and self._error is None and not self._chunks:
            conn.release()
        else:
            conn.abort()

    def _release(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.release()

    # --- fed by the connection ----------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: HttpError) -> None:
        self._error = error
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one response at a time."""

    def __init__(self, pool: HttpPool):
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: HttpResponse | None = None
        self.head: asyncio.Future | None = None  # set when the response's headers are in
        self.answered = False  # a byte of the current response arrived
        self.keep_alive = False
        self.closed = False
        self.paused = False
        self._name = b""

    # asyncio.Protocol
    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for (an idle connection): not HTTP we can use
            self.abort()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(HttpError(f"malformed HTTP response: {exc}", sent=True))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost(HttpError(f"connection lost: {exc or 'closed by the backend'}", sent=self.answered or self.response is not None))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.response.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.response._body(body)

    def on_message_complete(self) -> None:
        self.response._end()

    # pool side
    def send(self, head: bytes, body: bytes) -> tuple[HttpResponse, asyncio.Future]:
        self.response = HttpResponse(self)
        self.head = self.loop.create_future()
        self.answered = False
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return self.response, self.head

    def _lost(self, error: HttpError) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: the sender may have gone already
        if self.response is not None and not self.response._done:
            self.response._fail(error)

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def release(self) -> None:
        self.response = None
        self.head = None
        if self.keep_alive and not self.closed and len(self.pool._idle) < self.pool.max_idle:
            self.pool._idle.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """Keep-alive connections to one backend (``url``: ``http(s)://host:port``).

    Args:
        max_idle: idle connections kept (default 256); more may be open at once.
        connect_timeout_s: the most a new connection may take (default 5 s).
    """

    def __init__(self, url: str, max_idle: int = 256, connect_timeout_s: float = 5.0):
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.max_idle = max_idle
        self.connect_timeout_s = connect_timeout_s
        self._host_header = parts.netloc.encode("latin-1")
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as exc:
            raise HttpError(f"cannot connect: {type(exc).__name__}", sent=False) from None
        return conn

    def head(self, method: str, path: str, body: bytes, headers: bytes = b"") -> bytes:
        """The request line and headers (``headers``: extra ``Name: value\\r\\n`` lines)."""
        return b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
            method.encode(), path.encode(), self._host_header, len(body), headers)

    async def request(self, method: str, path: str, body: bytes = b"", headers: bytes = b"") -> HttpResponse:
        """Send the request and wait for the response's status and headers."""
        head = self.head(method, path, body, headers)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            response, ready = conn.send(head, body)
            try:
                await ready
                return response
            except HttpError:
                conn.abort()
                if conn.answered:
                    raise
                # NOTE: the backend closed this idle connection as the request went out;
                # it read nothing of it, so sending it again is safe.
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect()
        response, ready = conn.send(head, body)
        try:
            await ready
        except BaseException:
            conn.abort()
            raise
        return response

    def close(self) -> None:
        """Close the idle connections (responses being read keep theirs until closed)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
