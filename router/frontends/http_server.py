"""uvicorn for the HTTP front door, guarded against slow and broken clients.

uvicorn itself times out only idle keep-alive connections. ``guarded_protocol`` wraps
its HTTP protocol class (``parser_protocol``: httptools when installed, else h11) with:

* a header timeout: a connection must deliver a complete request head within
  ``header_timeout_s`` of its first byte (or of being accepted), else it is closed, with
  a 408 when it had sent something (slowloris);
* a body timeout: once the head is in, the whole body must arrive within
  ``body_timeout_s`` (a chunked body that never ends, a Content-Length longer than the
  body): the client gets a 408 when no response has started, and the connection closes;
* a first-byte timeout: a connection that sends nothing within ``idle_timeout_s`` of
  being accepted is closed without a response (idle sockets are the cheapest way to fill
  the cap);
* request-head limits: a head over ``max_header_bytes`` or with more than
  ``max_headers`` header lines gets a 431 and the connection closes, before the parser
  (or the app) sees the rest of it;
* a connection cap: beyond ``max_connections`` open connections the oldest connection
  that holds no request (it has sent nothing yet, or is an idle keep-alive) is closed
  to make room, as nginx drains its "reusable" connections; only when every connection
  carries a request does a new one get a 503 and close at once;
* a per-peer share: one peer address may hold at most ``max_connections_per_peer``
  connections (beyond it, its own oldest idle one makes room, else 503), so one client
  cannot take the whole cap;
* a one-second tick (``QuietServer``): uvicorn wakes its loop ten times a second to look
  for a stop request and refresh the Date header; this server does so once a second and
  wakes at once when told to stop, so an idle router costs next to nothing;
* coalesced writes (``CoalescingTransport``): the writes of one loop iteration share a
  send, and a response's head waits for its first body write, so a streamed response
  whose events are ready together is one or two sends, not one per event (an 8-token
  stream made 11, and those sends were a third of the router's CPU per request).

Error bodies use the front door's one mapping (``openai_errors``). Each closure is one
INFO line. Invariants: a connection is never in the head or body phase longer than its
timeout (plus the loop's scheduling delay) without being closed; a connection is in its
server's idle table exactly while it holds no request (accepted with no byte yet, or
kept alive between requests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus

import uvicorn

from unicache.plumbing.coalesce import CoalescingWriter
from unicache.plumbing.errors import UsageError
from unicache.router.frontends.openai_errors import ApiError

log = logging.getLogger(__name__)

TIMED_OUT_SCOPE_KEY = "unicache.timed_out"  # set when the guard closed for a body timeout (and logged it)
# A request's scope holds this list on this server: callables run when its connection is
# lost before its response completed (the app's disconnect watch, without a task of its own)
DISCONNECT_HOOKS_SCOPE_KEY = "unicache.on_disconnect"
LINGER_S = 2.0  # how long a refused connection's remaining input is read and dropped


@dataclass(slots=True, frozen=True)
class HttpLimits:
    """Connection limits of the HTTP front door (see the module docstring).

    Args:
        header_timeout_s: time to send a complete request head (10 s).
        body_timeout_s: time to send the body once the head is in (30 s).
        keepalive_timeout_s: idle time between requests on a kept-alive connection (5 s).
        max_connections: open connections beyond which an idle one is closed, or the
            new one gets 503 (4096).
        idle_timeout_s: time from accept to the first byte (2 s).
        max_header_bytes: largest request head, request line included (32 KiB, as
            nginx's default large_client_header_buffers; 431 beyond).
        max_headers: most header lines in one request (100, as Apache's
            LimitRequestFields; 431 beyond).
        max_connections_per_peer: connections one peer address may hold (1024, a quarter
            of the cap; 0: no share). Behind a proxy every client is one peer: raise it.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    max_connections: int = 4096
    idle_timeout_s: float = 2.0
    max_header_bytes: int = 32 << 10
    max_headers: int = 100
    max_connections_per_peer: int = 1024

    @classmethod
    def from_config(cls, config) -> "HttpLimits":  # noqa: ANN001 - a RouterConfig
        """The limits set by a router config's ``http_*`` fields."""
        return cls(
            header_timeout_s=config.http_header_timeout_s,
            body_timeout_s=config.http_body_timeout_s,
            keepalive_timeout_s=config.http_keepalive_timeout_s,
            max_connections=config.http_max_connections,
            idle_timeout_s=config.http_idle_timeout_s,
            max_header_bytes=config.http_max_header_bytes,
            max_headers=config.http_max_headers,
            max_connections_per_peer=config.http_max_connections_per_peer,
        )


@dataclass(slots=True)
class ConnectionTable:
    """The connections of one server that count against shares: ``idle`` holds, oldest
    first, those with no request (the ones closed to make room); ``per_peer`` counts open
    connections by peer host."""

    idle: OrderedDict = field(default_factory=OrderedDict)
    per_peer: dict[str, int] = field(default_factory=dict)

    def oldest_idle(self, peer: str | None = None):  # noqa: ANN201
        """The oldest idle connection (of ``peer`` when given), or None."""
        for proto in self.idle:
            if peer is None or proto._guard_peer == peer:
                return proto
        return None


def raw_error(err: ApiError) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = json.dumps(err.body()).encode()
    head = (
        f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


HTTP_PARSERS = ("auto", "httptools", "h11")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def parser_protocol(name: str = "auto") -> type:
    """uvicorn's protocol class for ``name``: "httptools" (C parser), "h11" (pure
    Python), or "auto" (httptools when installed, else h11). UsageError otherwise."""
    if name not in HTTP_PARSERS:
        raise UsageError(f"unknown http_parser {name!r} (choose from {', '.join(HTTP_PARSERS)})")
    if name in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            if name == "httptools":
                raise UsageError("http_parser httptools: the httptools package is not installed") from None
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def loop_factory(name: str = "auto"):
    """An event-loop factory for ``asyncio.Runner``: uvloop's ("uvloop", or "auto" when
    installed) or None (asyncio's default loop). UsageError for an unknown name."""
    if name not in EVENT_LOOPS:
        raise UsageError(f"unknown event_loop {name!r} (choose from {', '.join(EVENT_LOOPS)})")
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise UsageError("event_loop uvloop: the uvloop package is not installed") from None
        return None
    return uvloop.new_event_loop


class CoalescingTransport(CoalescingWriter):
    """The transport uvicorn's protocol writes to: ``CoalescingWriter`` over the
    connection's transport, which answers every other call (``is_closing``,
    ``get_extra_info``, ``pause_reading``, ``abort``, ...). ``hold_next()`` makes the next
    write a ``hold`` (the protocol calls it once a request is in, so the response's head
    leaves with the first body chunk or the whole body; uvicorn writes them separately).
    ``abort()`` drops what is pending (the transport is closing)."""

    __slots__ = ("_hold_next",)

    def __init__(self, transport, loop):
        super().__init__(transport, loop)
        self._hold_next = False

    def hold_next(self) -> None:
        self._hold_next = True

    def write(self, data: bytes) -> None:
        if self._hold_next:
            self._hold_next = False
            self.hold(data)
        else:
            super().write(data)

    def __getattr__(self, name: str):
        if name == "transport":  # not set yet (a half-built object): no recursion through it
            raise AttributeError(name)
        return getattr(self.transport, name)


def guarded_protocol(limits: HttpLimits, base: type | None = None) -> type:
    """A subclass of uvicorn's HTTP protocol (``base``, default ``parser_protocol()``) that
    enforces ``limits``. It relies on what both uvicorn protocols share: ``self.cycle``
    is replaced when a request head completes, and ``cycle.more_body`` turns False when
    its body is complete."""
    base = base or parser_protocol()

    table = ConnectionTable()
    share = limits.max_connections_per_peer

    class GuardedHttpProtocol(base):  # type: ignore[misc, valid-type]
        _guard_timer: asyncio.TimerHandle | None = None
        _guard_phase = "head"  # head (waiting for a request head), body, app, idle
        _guard_cycle = None
        _guard_bytes = 0
        _guard_head_bytes = 0  # of the head being received
        _guard_head_lines = 0
        _guard_tail = b""  # the head's last 3 bytes, to find a CRLFCRLF split across reads
        _guard_peer: str | None = None
        _guard_refused = False

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(CoalescingTransport(transport, asyncio.get_running_loop()))
            peer = (self.client or ("unknown",))[0]
            if share and table.per_peer.get(peer, 0) >= share and not self._guard_make_room(peer):
                self._guard_refuse(transport, f"too many connections from your address (share {share}); retry later")
                return
            if len(self.connections) > limits.max_connections and not self._guard_make_room(None):
                log.info("closing connection from %s: %d connections open (cap %d)", _peer(self), len(self.connections) - 1, limits.max_connections)
                self._guard_refuse(transport, f"too many connections (cap {limits.max_connections}); retry later")
                return
            self._guard_peer = peer
            table.per_peer[peer] = table.per_peer.get(peer, 0) + 1
            table.idle[self] = None
            self._guard_arm("head", min(limits.idle_timeout_s, limits.header_timeout_s))

        def connection_lost(self, exc) -> None:  # noqa: ANN001
            self._guard_cancel()
            table.idle.pop(self, None)
            peer = self._guard_peer
            if peer is not None:
                self._guard_peer = None
                left = table.per_peer[peer] - 1
                if left:
                    table.per_peer[peer] = left
                else:
                    del table.per_peer[peer]
            super().connection_lost(exc)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                for hook in cycle.scope.get(DISCONNECT_HOOKS_SCOPE_KEY) or ():
                    hook()

        def data_received(self, data: bytes) -> None:
            if self._guard_refused:
                return
            if self._guard_phase == "idle":  # the next request on a kept-alive connection
                self._guard_arm("head", limits.header_timeout_s)
            elif self._guard_phase == "head" and not self._guard_bytes:  # the first byte
                self._guard_arm("head", limits.header_timeout_s)
            table.idle.pop(self, None)
            self._guard_bytes += len(data)
            if self._guard_phase == "head" and self._guard_head_too_large(data):
                return
            super().data_received(data)
            self._guard_progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._guard_phase == "app":
                self._guard_cancel()
                cycle = self.cycle
                if cycle is not None and not cycle.response_complete:
                    # NOTE: a pipelined request, parsed while this one was answered, is
                    # under way now: the connection holds a request, it is not idle.
                    self._guard_cycle = cycle
                    cycle.scope[DISCONNECT_HOOKS_SCOPE_KEY] = []
                    if cycle.more_body:
                        self._guard_arm("body", limits.body_timeout_s)
                    else:
                        self._guard_app()
                    return
                self._guard_phase = "idle"  # uvicorn's keep-alive timeout applies
                self._guard_head_bytes = self._guard_head_lines = 0
                self._guard_tail = b""
                if not self.transport.is_closing():
                    table.idle[self] = None

        # -- guard ------------------------------------------------------------------
        def send_400_response(self, msg: str) -> None:
            """The parser's own 400 (a malformed request: control characters in a header,
            a bad request line), in OpenAI's shape like every other error."""
            log.info("closing connection from %s: %s", _peer(self), msg)
            self._guard_linger(raw_error(ApiError(400, f"malformed HTTP request ({msg.rstrip('.')})", "invalid_request")))

        def _guard_make_room(self, peer: str | None) -> bool:
            """Close the oldest idle connection (of ``peer`` when given); False if none."""
            victim = table.oldest_idle(peer)
            if victim is None:
                return False
            log.info("closing idle connection from %s to make room (%s)", _peer(victim), "peer share" if peer else "connection cap")
            table.idle.pop(victim, None)
            victim._guard_cancel()
            victim.transport.close()
            return True

        def _guard_refuse(self, transport, message: str) -> None:  # noqa: ANN001
            self._guard_refused = True
            transport.write(raw_error(ApiError(503, message, "too_many_connections")))
            transport.close()

        def _guard_head_too_large(self, data: bytes) -> bool:
            """Count the head's bytes and lines in ``data``; past a limit, answer 431 and
            close (True). The parser never sees the oversized head."""
            seen = self._guard_tail + data
            end = seen.find(b"\r\n\r\n")
            part = data if end < 0 else seen[len(self._guard_tail) : end + 4]
            self._guard_head_bytes += len(part)
            self._guard_head_lines += part.count(b"\n")
            self._guard_tail = seen[-3:] if end < 0 else b""
            # NOTE: the request line and the blank line are two of the head's lines.
            if self._guard_head_lines > limits.max_headers + 2:
                why = f"more than {limits.max_headers} request header fields"
            elif self._guard_head_bytes > limits.max_header_bytes:
                why = f"request head larger than {limits.max_header_bytes} bytes"
            else:
                if end >= 0:  # the next head on this connection starts from zero
                    self._guard_head_bytes = self._guard_head_lines = 0
                return False
            log.info("closing connection from %s: %s", _peer(self), why)
            self._guard_linger(raw_error(ApiError(431, why)))
            return True

        def _guard_linger(self, response: bytes) -> None:
            """Send ``response``, end our side, and discard what the client still sends
            for up to ``LINGER_S`` before closing: closing with unread data would reset
            the connection, and the client would lose the response (nginx's lingering
            close)."""
            self._guard_cancel()
            self._guard_refused = True
            transport = self.transport
            transport.flush()
            raw = transport.transport
            raw.write(response)
            if raw.can_write_eof():
                raw.write_eof()
            self._guard_timer = self.loop.call_later(LINGER_S, raw.close)

        def _guard_progress(self) -> None:
            cycle = self.cycle
            if self._guard_phase == "head" and cycle is not None and cycle is not self._guard_cycle:
                self._guard_cycle = cycle
                cycle.scope[DISCONNECT_HOOKS_SCOPE_KEY] = []  # before the app's task first runs
                if cycle.more_body:
                    self._guard_arm("body", limits.body_timeout_s)
                else:
                    self._guard_app()
            elif self._guard_phase == "body" and not cycle.more_body:
                self._guard_app()

        def _guard_app(self) -> None:
            """The request is in: the app answers it (its head waits for the body)."""
            self._guard_cancel()
            self._guard_phase = "app"
            self.transport.hold_next()

        def _guard_arm(self, phase: str, timeout_s: float) -> None:
            self._guard_cancel()
            self._guard_phase = phase
            self._guard_timer = self.loop.call_later(timeout_s, self._guard_expired)

        def _guard_cancel(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def _guard_expired(self) -> None:
            self._guard_timer = None
            if self.transport.is_closing():
                return
            if self._guard_phase == "head":
                if self._guard_bytes:
                    log.info("closing connection from %s: no complete request head within %.3g s", _peer(self), limits.header_timeout_s)
                    self.transport.write(raw_error(ApiError(408, f"request head not received within {limits.header_timeout_s:g} s")))
                else:
                    log.info("closing connection from %s: nothing sent within %.3g s", _peer(self), min(limits.idle_timeout_s, limits.header_timeout_s))
            elif self._guard_phase == "body":
                log.info("closing connection from %s: request body not received within %.3g s", _peer(self), limits.body_timeout_s)
                cycle = self.cycle
                cycle.scope[TIMED_OUT_SCOPE_KEY] = True
                if not cycle.response_started:
                    self.transport.write(raw_error(ApiError(408, f"request body not received within {limits.body_timeout_s:g} s")))
            else:
                return
            self.transport.close()

    GuardedHttpProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHttpProtocol


def _peer(protocol) -> str:  # noqa: ANN001
    client = getattr(protocol, "client", None)
    return f"{client[0]}:{client[1]}" if client else "unknown"


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop ticks once a second, not ten times, and wakes at
    once when ``should_exit`` is set (the Date header, refreshed each tick, stays exact to
    the second)."""

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config):
        self._exit_requested = asyncio.Event()  # before uvicorn's __init__ sets should_exit
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value:
            self._exit_requested.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header when counter % 10 == 0
            try:
                await asyncio.wait_for(self._exit_requested.wait(), self.TICK_S)
            except TimeoutError:
                pass


def uvicorn_config(app, limits: HttpLimits, protocol_base: type | None = None) -> uvicorn.Config:  # noqa: ANN001
    """The uvicorn settings of the front door (quiet logs, no lifespan, guarded protocol)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits, protocol_base),
        interface="asgi3",  # NOTE: uvicorn's guess takes a bound async method for ASGI 2
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_keep_alive=limits.keepalive_timeout_s,  # type: ignore[arg-type]
        # NOTE: above the guard's own head limit, so the guard answers (431) and h11 never does (400).
        h11_max_incomplete_event_size=limits.max_header_bytes + 1024,
    )
