"""Coalesced writes (``unicache.plumbing.coalesce``): the hop's frames and the HTTP front door's
responses. Exact sends, on a transport that records them."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from unicache.plumbing.coalesce import CoalescingWriter
from unicache.router.frontends.http_server import CoalescingTransport, HttpLimits, parser_protocol, uvicorn_config


class _RecordingTransport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def test_the_first_write_leaves_now_and_the_rest_of_the_iteration_together():
    transport = _RecordingTransport()
    out = CoalescingWriter(transport, asyncio.get_running_loop())
    out.write(b"a")
    assert transport.writes == [b"a"]  # the first write of an iteration never waits
    out.write(b"b")
    out.write(b"cd")
    assert transport.writes == [b"a"]
    await asyncio.sleep(0)
    assert transport.writes == [b"a", b"bcd"]  # the rest in one send, in order
    await asyncio.sleep(0)
    out.write(b"e")
    assert transport.writes == [b"a", b"bcd", b"e"]  # a new iteration: at once again
    out.write(b"refusal")
    out.close()  # flushes before closing: the last write still leaves
    assert transport.writes == [b"a", b"bcd", b"e", b"refusal"] and transport.closed
    out.write(b"late")
    await asyncio.sleep(0)
    out.write(b"later")
    assert transport.writes == [b"a", b"bcd", b"e", b"refusal"]  # dropped once closing


async def test_held_data_leaves_with_the_next_write_or_alone_at_the_next_iteration():
    transport = _RecordingTransport()
    out = CoalescingWriter(transport, asyncio.get_running_loop())
    out.hold(b"head")
    assert transport.writes == []
    out.write(b"1")
    out.write(b"2")
    assert transport.writes == [b"head1"]  # the held data rides the first write's send
    await asyncio.sleep(0)
    assert transport.writes == [b"head1", b"2"]
    out.hold(b"h2")
    await asyncio.sleep(0)
    assert transport.writes == [b"head1", b"2", b"h2"]  # nothing followed: alone, one iteration later
    out.write(b"3")
    assert transport.writes == [b"head1", b"2", b"h2", b"3"]  # the held data's flush did not arm


async def test_the_http_transport_holds_once_on_request_and_passes_other_calls_through():
    raw = _RecordingTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    assert t.get_extra_info("peername") == ("127.0.0.1", 5000)
    t.pause_reading()
    assert raw.reading is False
    t.hold_next()
    t.write(b"H")
    assert raw.writes == []
    t.write(b"B")
    assert raw.writes == [b"HB"]
    t.close()
    assert raw.closed and t.is_closing()


EVENTS = [b"data: %d\n\n" % i for i in range(8)]


def _sse_app(spread: bool):
    async def app(scope, receive, send):
        assert scope["type"] == "http"
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for e in EVENTS:
            await send({"type": "http.response.body", "body": e, "more_body": True})
            if spread:
                await asyncio.sleep(0)  # the next event comes in a later loop iteration
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n"


def _connected(parser: str, app):
    """The front door's guarded uvicorn protocol (``parser``) serving ``app``, connected
    to a recording transport: (protocol, transport)."""
    config = uvicorn_config(app, HttpLimits(), parser_protocol(parser))
    config.load()
    proto = config.http_protocol_class(config=config, server_state=uvicorn.server.ServerState(), app_state={})
    raw = _RecordingTransport()
    proto.connection_made(raw)
    return proto, raw


async def _serve_one_connection(parser: str, app, requests: int) -> list[bytes]:
    proto, raw = _connected(parser, app)
    for _ in range(requests):
        before = len(raw.writes)
        proto.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        for _ in range(50):
            await asyncio.sleep(0)
            if raw.writes and raw.writes[-1].endswith(b"0\r\n\r\n") and len(raw.writes) > before:
                break
        await asyncio.sleep(0)
    proto.connection_lost(None)
    return raw.writes


@pytest.mark.parametrize("parser", ["httptools", "h11"])
async def test_a_streamed_response_ready_at_once_is_two_sends(parser):
    writes = await _serve_one_connection(parser, _sse_app(spread=False), requests=2)
    assert len(writes) == 4  # per response: head + first event, then the rest together
    for head_first, rest in (writes[0:2], writes[2:4]):
        assert head_first.startswith(b"HTTP/1.1 200 OK\r\n") and head_first.endswith(b"\r\n\r\n" + _chunked(EVENTS[0]))
        assert rest == b"".join(_chunked(e) for e in EVENTS[1:]) + b"0\r\n\r\n"


@pytest.mark.parametrize("parser", ["httptools", "h11"])
async def test_events_of_different_iterations_leave_at_once(parser):
    writes = await _serve_one_connection(parser, _sse_app(spread=True), requests=1)
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(_chunked(EVENTS[0]))
    assert writes[1:] == [_chunked(e) for e in EVENTS[1:]] + [b"0\r\n\r\n"]  # none waits for another


@pytest.mark.parametrize("parser", ["httptools", "h11"])
async def test_a_100_continue_leaves_at_once_and_the_response_after_the_body(parser):
    """curl sends ``Expect: 100-continue`` with bodies over 1 KiB and waits for the 100
    before sending the body: the 100 must reach it with no body write to ride on (a
    held write that waited for one would deadlock); the response then goes out as for
    any request."""
    proto, raw = _connected(parser, _sse_app(spread=False))
    proto.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
    for _ in range(5):
        await asyncio.sleep(0)
    assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    proto.data_received(b"{}")
    for _ in range(10):
        await asyncio.sleep(0)
    proto.connection_lost(None)
    assert len(raw.writes) == 3 and raw.writes[1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert raw.writes[1].endswith(_chunked(EVENTS[0])) and raw.writes[2].endswith(b"0\r\n\r\n")
