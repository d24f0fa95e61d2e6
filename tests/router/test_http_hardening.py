"""The HTTP front door against slow and broken clients, over raw sockets.

A router with short limits (header and body timeouts 0.5 s, keep-alive 0.5 s) over a
fake replica, with either HTTP parser (httptools, h11). Each case asserts the exact outcome (status line, then the connection
closed by the server); the only time bound is the socket's own read timeout, far above
the configured one (closure, not speed, is what is checked).
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica

HEADER_S = BODY_S = KEEPALIVE_S = 0.5
READ_TIMEOUT_S = 20.0  # generous: the server must close long before this
MAX_CONNECTIONS = 256


async def start_router(rep: FakeReplica, **overrides) -> RouterApp:
    cfg = {
        "grpc_port": 0,
        "http_port": 0,
        "use_redis": False,
        "replicas": f"{rep.replica_id}={rep.address}",
        "routing_policy": "round_robin",
        "auth_enabled": False,
        "http_header_timeout_s": HEADER_S,
        "http_body_timeout_s": BODY_S,
        "http_keepalive_timeout_s": KEEPALIVE_S,
        "http_max_connections": MAX_CONNECTIONS,
    }
    cfg.update(overrides)
    app = RouterApp(build_config(env={}, overrides=cfg))
    await app.start()
    return app


@pytest.fixture(params=["httptools", "h11"])
async def router(request):
    """The router with each of uvicorn's HTTP parsers under the guard."""
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_parser=request.param)
    try:
        yield app, rep
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def connect(app: RouterApp):
    return await asyncio.open_connection("127.0.0.1", app.http_port)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (TimeoutError if it never does)."""
    return await asyncio.wait_for(reader.read(), READ_TIMEOUT_S)


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def request_head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}\r\n".encode()


@pytest.mark.parametrize(
    "case",
    ["content_length_longer_than_body", "chunked_body_that_never_ends"],
)
async def test_slow_body_gets_408_and_is_closed(router, case):
    app, rep = router
    reader, writer = await connect(app)
    if case == "content_length_longer_than_body":
        writer.write(request_head("/v1/completions", "content-length: 100\r\n") + b'{"prompt": "x"')
    else:
        writer.write(request_head("/v1/completions", "transfer-encoding: chunked\r\n") + b'5\r\n{"pro\r\n')
    await writer.drain()
    raw = await read_until_closed(reader)
    status, body = status_and_json(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert body["error"]["type"] == "invalid_request_error"
    assert rep.requests == []
    writer.close()


async def test_200_slowloris_connections_are_all_closed(router):
    app, _ = router

    async def slowloris(i: int) -> bytes | None:
        """Trickle a head that never ends; what the server sent before closing (None:
        it reset the connection, which it does when trickled bytes arrive after its close)."""
        reader, writer = await connect(app)
        try:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow-{i}: ".encode())
            for _ in range(2):
                await asyncio.sleep(HEADER_S / 5)
                writer.write(b"a")
            return await read_until_closed(reader)
        except ConnectionResetError:
            return None
        finally:
            writer.close()

    results = await asyncio.gather(*(slowloris(i) for i in range(200)))
    assert len(results) == 200  # every one closed by the server (else read_until_closed times out)
    assert {status_and_json(raw)[0] for raw in results if raw is not None} <= {408}
    assert sum(raw is not None for raw in results) > 0


async def test_a_silent_connection_is_closed_without_a_response(router):
    app, _ = router
    reader, writer = await connect(app)
    assert await read_until_closed(reader) == b""
    writer.close()


async def test_idle_keepalive_connection_is_closed(router):
    app, _ = router
    reader, writer = await connect(app)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    raw = await read_until_closed(reader)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'"redis_connected":false}')
    writer.close()


async def test_keepalive_requests_each_get_their_own_header_timeout(router):
    app, _ = router
    reader, writer = await connect(app)
    for _ in range(3):  # well-formed requests on one connection keep working
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 200")
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # then a head that never ends
    status, _ = status_and_json(await read_until_closed(reader))
    assert status == 408
    writer.close()


async def test_connections_beyond_the_cap_get_503():
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_max_connections=3, http_header_timeout_s=60.0)
    try:
        held = [await connect(app) for _ in range(3)]
        for _, w in held:  # each holds a request (idle ones would be closed to make room)
            w.write(b"GET /readyz HTTP/1.1\r\nhost: x\r\n")
        await asyncio.sleep(0.05)  # let the server accept them and read the heads' start
        reader, writer = await connect(app)
        status, body = status_and_json(await read_until_closed(reader))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        writer.close()
        # The held connections still serve.
        r, w = held[0]
        w.write(b"connection: close\r\n\r\n")
        assert (await read_until_closed(r)).startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def test_client_gone_during_upload_is_one_info_line(router, caplog):
    app, rep = router
    caplog.set_level(logging.INFO)
    reader, writer = await connect(app)
    writer.write(request_head("/v1/completions", "content-length: 1000\r\n") + b'{"prompt": ')
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    for _ in range(500):
        if app.metrics.requests.labels("completions", "cancelled")._value.get() == 1:
            break
        await asyncio.sleep(0.01)
    assert app.metrics.requests.labels("completions", "cancelled")._value.get() == 1
    lines = [r for r in caplog.records if "disconnected during its upload" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert [r for r in caplog.records if r.exc_info] == []
    assert rep.requests == []


async def test_cancelled_sse_stream_counts_as_cancelled_not_error(router):
    app, rep = router
    rep.hold = asyncio.Event()  # the replica sends one token, then waits
    reader, writer = await connect(app)
    body = json.dumps({"prompt": "stream me", "max_tokens": 4, "stream": True}).encode()
    writer.write(request_head("/v1/completions", f"content-length: {len(body)}\r\n") + body)
    await asyncio.wait_for(reader.readuntil(b"data: "), READ_TIMEOUT_S)  # the stream started
    writer.close()
    await asyncio.wait_for(rep.cancelled.wait(), READ_TIMEOUT_S)
    for _ in range(500):
        if app.metrics.requests.labels("completions", "cancelled")._value.get() == 1:
            break
        await asyncio.sleep(0.01)
    counts = {o: app.metrics.requests.labels("completions", o)._value.get() for o in ("cancelled", "error", "ok")}
    assert counts == {"cancelled": 1, "error": 0, "ok": 0}


def test_unknown_parser_or_loop_is_a_usage_error():
    from unicache.plumbing.errors import UsageError
    from unicache.router.frontends.http_server import loop_factory, parser_protocol

    with pytest.raises(UsageError, match="unknown http_parser 'fast'"):
        parser_protocol("fast")
    with pytest.raises(UsageError, match="unknown event_loop 'tokio'"):
        loop_factory("tokio")
    assert parser_protocol("h11").__name__ == "H11Protocol"
    assert loop_factory("asyncio") is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"http_parser": "fast"}, "unknown http_parser 'fast'"),
        ({"event_loop": "tokio"}, "unknown event_loop 'tokio'"),
        ({"http_body_timeout_s": 0}, "http_body_timeout_s must be positive"),
        ({"http_max_connections": -1}, "http_max_connections must be positive"),
    ],
)
def test_bad_http_settings_fail_at_build_time(overrides, message):
    from unicache.plumbing.errors import UsageError

    with pytest.raises(UsageError, match=message):
        build_config(env={}, overrides=overrides)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_router_bug_in_generation_is_a_500_in_openai_shape_and_logged(router, path, monkeypatch, caplog):
    """The generation routes bypass Starlette's middleware (HttpFrontDoor.app): a failure
    there still answers 500 ``internal_error`` (no traceback), uvicorn logs it, and the
    connection's other routes still go through Starlette."""
    import httpx

    app, rep = router

    def broken(*args, **kwargs):
        raise RuntimeError("secret detail of a router bug")

    monkeypatch.setattr(app.core, "prepare", broken)
    body = {"prompt": "hi", "max_tokens": 1} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=READ_TIMEOUT_S) as client:
        with caplog.at_level(logging.ERROR):
            r = await client.post(path, json=body)
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal_error" and "secret" not in r.text
        assert any("secret detail of a router bug" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)
        r = await client.get(path)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert rep.served == []


async def test_the_server_ticks_once_a_second_and_stops_at_once():
    """``QuietServer``: no 0.1 s wake-ups while idle, and setting ``should_exit`` ends the
    main loop without waiting out a tick (one of an hour here)."""
    import uvicorn

    from unicache.router.frontends.http_server import QuietServer

    async def app(scope, receive, send):  # noqa: ARG001 - never called
        raise AssertionError("no request is sent")

    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    server.TICK_S = 3600.0
    ticks = []
    original = server.on_tick

    async def counting(counter):
        ticks.append(counter)
        return await original(counter)

    server.on_tick = counting
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    assert ticks == [0]  # uvicorn's own loop would have ticked three more times
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    assert ticks == [0, 10] and server.server_state.default_headers[0][0] == b"date"


async def test_an_event_stream_whose_client_is_gone_before_the_first_send_still_closes_its_body():
    """Closing an async generator that never started runs none of its code: the response
    starts the body before its first send, so the upstream calls behind it are closed
    however early the client goes."""
    from unicache.router.frontends.http_api import _EventStream, _Watch

    closed = []

    async def body():
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    never = asyncio.Event()

    async def receive():
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("client gone")

    response = _EventStream(body(), _Watch({}, receive), {})
    with pytest.raises(OSError, match="client gone"):
        await response(None, receive, send)
    assert closed == [True]
