"""The replica's Prometheus endpoint: ``GET /metrics`` on its own port, served on the
replica's event loop.

NOTE: prometheus_client's ``start_http_server`` serves from a thread; the scrape-time
collectors read the engine (replica/publishing/metrics.py), and the vLLM engine's status socket is
not thread-safe, so this serves on the loop instead: one request per connection, a
deadline on reading it, nothing else.

Invariants:
    * ``GET /metrics`` (any query string) answers 200 with the text exposition of every
      registry given; any other path 404, any other method 405; a request line that does
      not arrive within ``read_timeout_s`` or exceeds ``MAX_REQUEST_BYTES`` closes the
      connection.
    * Port 0 binds a free port; a fixed port binds the first free one of its span (else
      ``start`` raises the last ``OSError``); ``port`` and ``url`` read it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192


class MetricsServer:
    """Serves ``registries`` (concatenated, each family once) at ``http://host:port/metrics``.

    Args:
        registries: what to expose, in order (the replica's own, then vLLM's global one
            when the vLLM engine runs).
        host: interface to bind.
        port: port to bind; 0 picks a free one.
        advertise_host: host part of ``url`` (default ``host``).
        read_timeout_s: deadline for a client to send its request head.
        port_span: with a fixed ``port``, try ``port .. port + port_span - 1`` and bind the
            first free one (several replicas on one pod each get one of a declared range).
    """

    def __init__(
        self,
        registries: Sequence[CollectorRegistry],
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "",
        read_timeout_s: float = 5.0,
        port_span: int = 1,
    ):
        self.registries = list(registries)
        self.host = host
        self.requested_port = port
        self.advertise_host = advertise_host or host
        self.read_timeout_s = read_timeout_s
        self.port_span = port_span if port else 1
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}/metrics" if self.port else ""

    async def start(self) -> int:
        for i in range(self.port_span):
            try:
                self._server = await asyncio.start_server(
                    self._handle, self.host, self.requested_port + i if self.requested_port else 0, limit=MAX_REQUEST_BYTES
                )
                break
            except OSError:
                if i == self.port_span - 1:
                    raise
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("replica metrics on %s", self.url)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def render(self) -> bytes:
        return b"".join(generate_latest(r) for r in self.registries)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        try:
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        except ValueError:
            method, target = "", ""
        path = target.split("?", 1)[0]
        if path != "/metrics":
            status, body, ctype = "404 Not Found", b"not found: the metrics are at /metrics\n", "text/plain"
        elif method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"use GET\n", "text/plain"
        else:
            status, body, ctype = "200 OK", self.render(), CONTENT_TYPE_LATEST
        head_out = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        try:
            writer.write(head_out.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
