"""uvicorn for the HTTP front door, guarded against slow and broken clients.

uvicorn itself times out only idle keep-alive connections. ``guarded_protocol`` wraps
its HTTP protocol class (``parser_protocol``: httptools when installed, else h11) with:

* a header timeout: a connection must deliver a complete request head within
  ``header_timeout_s`` of its first byte (or of being accepted), else it is closed, with
  a 408 when it had sent something (slowloris);
* a body timeout: once the head is in, the whole body must arrive within
  ``body_timeout_s`` (a chunked body that never ends, a Content-Length longer than the
  body): the client gets a 408 when no response has started, and the connection closes;
* a connection cap: beyond ``max_connections`` open connections a new one gets a 503
  and is closed at once;
* coalesced writes (``CoalescingTransport``): the writes of one loop iteration share a
  send, and a response's head waits for its first body write, so a streamed response
  whose events are ready together is one or two sends, not one per event (an 8-token
  stream made 11, and those sends were a third of the router's CPU per request).

Error bodies use the front door's one mapping (``openai_errors``). Each closure is one
INFO line. Invariant: a connection is never in the head or body phase longer than its
timeout (plus the loop's scheduling delay) without being closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import uvicorn

from unicache.coalesce import CoalescingWriter
from unicache.errors import UsageError
from unicache.router.openai_errors import ApiError

log = logging.getLogger(__name__)

TIMED_OUT_SCOPE_KEY = "unicache.timed_out"


@dataclass(slots=True, frozen=True)
class HttpLimits:
    """Connection limits of the HTTP front door (see the module docstring).

    Args:
        header_timeout_s: time to send a complete request head (10 s).
        body_timeout_s: time to send the body once the head is in (30 s).
        keepalive_timeout_s: idle time between requests on a kept-alive connection (5 s).
        max_connections: open connections beyond which new ones get 503 (4096).
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    max_connections: int = 4096


def raw_error(err: ApiError) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = json.dumps(err.body()).encode()
    head = (
        f"HTTP/1.1 {err.status} {'Request Timeout' if err.status == 408 else 'Service Unavailable'}\r\n"
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

    class GuardedHttpProtocol(base):  # type: ignore[misc, valid-type]
        _guard_timer: asyncio.TimerHandle | None = None
        _guard_phase = "head"  # head (waiting for a request head), body, app, idle
        _guard_cycle = None
        _guard_bytes = 0

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(CoalescingTransport(transport, asyncio.get_running_loop()))
            if len(self.connections) > limits.max_connections:
                log.info("closing connection from %s: %d connections open (cap %d)", _peer(self), len(self.connections) - 1, limits.max_connections)
                transport.write(raw_error(ApiError(503, f"too many connections (cap {limits.max_connections}); retry later", "too_many_connections")))
                transport.close()
                return
            self._guard_arm("head", limits.header_timeout_s)

        def connection_lost(self, exc) -> None:  # noqa: ANN001
            self._guard_cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._guard_phase == "idle":  # the next request on a kept-alive connection
                self._guard_arm("head", limits.header_timeout_s)
            self._guard_bytes += len(data)
            super().data_received(data)
            self._guard_progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._guard_phase == "app":
                self._guard_cancel()
                self._guard_phase = "idle"  # uvicorn's keep-alive timeout applies

        # -- guard ------------------------------------------------------------------
        def _guard_progress(self) -> None:
            cycle = self.cycle
            if self._guard_phase == "head" and cycle is not None and cycle is not self._guard_cycle:
                self._guard_cycle = cycle
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
                log.info("closing connection from %s: no complete request head within %.3g s", _peer(self), limits.header_timeout_s)
                if self._guard_bytes:
                    self.transport.write(raw_error(ApiError(408, f"request head not received within {limits.header_timeout_s:g} s")))
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
    )
