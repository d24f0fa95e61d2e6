"""The front doors' limits against header floods, bad routing headers, unknown models
and idle-connection floods (issue 39, "Front doors").

A router over a fake replica; each case asserts the exact status and error code, over
raw sockets where the client must misbehave (either HTTP parser), and which requests the
replica saw. Closure, never speed, is checked: read timeouts are far above the limits.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.router.test_http_hardening import READ_TIMEOUT_S, connect, read_until_closed, start_router, status_and_json

MAX_HEADER_BYTES = 8 << 10
MAX_HEADERS = 50


@pytest.fixture(params=["httptools", "h11"])
async def router(request):
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_parser=request.param, http_max_header_bytes=MAX_HEADER_BYTES, http_max_headers=MAX_HEADERS)
    try:
        yield app, rep
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


def completion(extra_headers: bytes = b"") -> bytes:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + extra_headers
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


async def send(app, raw: bytes) -> tuple[int, dict]:
    reader, writer = await connect(app)
    writer.write(raw)
    try:
        return status_and_json(await read_until_closed(reader))
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (b"x-big: " + b"a" * (1 << 20) + b"\r\n", f"request head larger than {MAX_HEADER_BYTES} bytes"),
        (b"".join(b"x-h%d: v\r\n" % i for i in range(10_000)), f"more than {MAX_HEADERS} request header fields"),
        (b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS - 3)), f"more than {MAX_HEADERS} request header fields"),
    ],
    ids=["1MiB_header", "10000_headers", "one_header_over"],
)
async def test_header_floods_get_431_and_never_reach_the_replica(router, headers, message):
    app, rep = router
    status, body = await send(app, completion(headers))
    assert (status, body["error"]["code"], body["error"]["message"]) == (431, "request_header_fields_too_large", message)
    assert body["error"]["type"] == "invalid_request_error"
    assert rep.served == []


async def test_heads_at_the_limits_are_served(router):
    app, rep = router
    # host, content-type, connection, content-length + 46 = MAX_HEADERS fields
    status, _ = await send(app, completion(b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS - 4))))
    assert status == 200
    status, _ = await send(app, completion(b"x-big: " + b"a" * (MAX_HEADER_BYTES - 200) + b"\r\n"))
    assert status == 200
    assert len(rep.served) == 2


@pytest.mark.parametrize(
    ("name", "value", "param", "message"),
    [
        (b"x-session-id", b"\xff\xfe", "session_id", "x-session-id header is not valid UTF-8"),
        (b"x-session-id", b"a\tb", "session_id", "x-session-id header contains control characters"),
        (b"x-session-id", "a\u0085b".encode(), "session_id", "x-session-id header contains control characters"),
        (b"x-session-id", b"s" * 257, "session_id", "x-session-id header is longer than 256 characters"),
        (b"x-unicache-task", b"\xc3\x28", "task", "x-unicache-task header is not valid UTF-8"),
        (b"x-unicache-task", "t\u009b2J".encode(), "task", "x-unicache-task header contains control characters"),
        (b"x-unicache-template", b"\xff", "template", "x-unicache-template header is not valid UTF-8"),
    ],
)
async def test_bad_routing_headers_get_400_in_openai_shape(router, name, value, param, message):
    app, rep = router
    status, body = await send(app, completion(name + b": " + value + b"\r\n"))
    assert status == 400
    assert body == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}}
    assert rep.served == []


async def test_c0_controls_in_a_header_are_refused_by_either_parser_in_openai_shape(router):
    """httptools refuses a C0 control in a header value itself (its 400, now in OpenAI's
    shape); h11 passes it on, and the routing-header check refuses it."""
    app, rep = router
    status, body = await send(app, completion(b"x-session-id: a\x01b\r\n"))
    if app.config.http_parser == "httptools":
        expected = {"message": "malformed HTTP request (Invalid HTTP request received)", "type": "invalid_request_error", "param": None, "code": "invalid_request"}
    else:
        expected = {"message": "x-session-id header contains control characters", "type": "invalid_request_error", "param": "session_id", "code": "invalid_value"}
    assert (status, body) == (400, {"error": expected})
    assert rep.served == []


async def test_utf8_session_header_is_served(router):
    app, rep = router
    status, _ = await send(app, completion("x-session-id: sesión-1\r\n".encode()))
    assert status == 200 and len(rep.served) == 1


@pytest.mark.parametrize(("model", "code"), [("gpt-4", grpc.StatusCode.NOT_FOUND), ("unicache-default", None), ("", None)])
async def test_grpc_unknown_model_is_not_found(model, code):
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            call = router_pb2_grpc.RouterStub(ch).Generate(
                router_pb2.RouterGenerateRequest(text="hi", model=model, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=READ_TIMEOUT_S
            )
            if code is None:
                assert len([m async for m in call]) >= 1 and len(rep.served) == 1
            else:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in call]
                assert err.value.code() == code
                assert err.value.details() == "The model 'gpt-4' does not exist; this server serves 'unicache-default'"
                assert rep.served == []
        assert app.metrics.requests.labels("grpc", "invalid")._value.get() == (1 if code else 0)
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout():
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_idle_timeout_s=0.3, http_header_timeout_s=60.0)
    try:
        reader, writer = await connect(app)
        assert await read_until_closed(reader) == b""  # closed long before the 60 s head timeout
        writer.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def test_idle_connections_at_the_cap_make_room_for_new_clients():
    """250 idle connections against a cap of 200: each beyond the cap closes the oldest
    idle one (50), and the first of 15 well-formed requests one more; all 15 are served
    (no 503) and the 199 newest idle connections stay open."""
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_max_connections=200, http_header_timeout_s=60.0, http_idle_timeout_s=60.0, http_max_connections_per_peer=0)
    try:
        idle = [await connect(app) for _ in range(250)]
        assert [await asyncio.wait_for(r.read(), READ_TIMEOUT_S) for r, _ in idle[:50]] == [b""] * 50
        statuses = [(await send(app, completion()))[0] for _ in range(15)]
        assert statuses == [200] * 15
        assert await asyncio.wait_for(idle[50][0].read(), READ_TIMEOUT_S) == b""
        await asyncio.sleep(0.05)
        assert [r.at_eof() for r, _ in idle[51:]] == [False] * 199
        for _, w in idle:
            w.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def test_a_peer_beyond_its_share_gets_503_when_none_of_its_connections_is_idle():
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_max_connections_per_peer=2, http_header_timeout_s=60.0, http_idle_timeout_s=60.0)
    try:
        busy = []
        for _ in range(2):  # two connections, each in the middle of a request head
            r, w = await connect(app)
            w.write(b"GET /readyz HTTP/1.1\r\nhost: x\r\n")
            await w.drain()
            busy.append((r, w))
        await asyncio.sleep(0.05)
        status, body = await send(app, b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (status, body["error"]["code"]) == (503, "too_many_connections")
        assert body["error"]["message"] == "too many connections from your address (share 2); retry later"
        r, w = busy[0]
        w.write(b"connection: close\r\n\r\n")  # the busy ones still serve
        assert (await read_until_closed(r)).startswith(b"HTTP/1.1 200")
        for _, w in busy:
            w.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


async def test_a_peer_at_its_share_replaces_its_own_oldest_idle_connection():
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_max_connections_per_peer=2, http_header_timeout_s=60.0, http_idle_timeout_s=60.0)
    try:
        idle = [await connect(app) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, _ = await send(app, b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert status == 200
        assert await asyncio.wait_for(idle[0][0].read(), READ_TIMEOUT_S) == b""
        assert not idle[1][0].at_eof()
        for _, w in idle:
            w.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"http_idle_timeout_s": 0}, "http_idle_timeout_s must be positive"),
        ({"http_max_header_bytes": 0}, "http_max_header_bytes must be positive"),
        ({"http_max_headers": -1}, "http_max_headers must be positive"),
        ({"http_max_connections_per_peer": -1}, "http_max_connections_per_peer must be >= 0"),
    ],
)
def test_bad_limit_settings_fail_at_build_time(overrides, message):
    from unicache.plumbing.errors import UsageError
    from unicache.router.config import build_config

    with pytest.raises(UsageError, match=message):
        build_config(env={}, overrides=overrides)


@pytest.mark.parametrize("parser", ["httptools", "h11"])
async def test_a_connection_answering_a_pipelined_request_is_not_taken_for_idle(parser):
    """A client pipelines a quick request and a slow one: once the first is answered the
    connection still carries the second, so a new connection at the cap closes a truly
    idle one instead, and the slow response arrives."""
    rep = FakeReplica("r0")
    await rep.start()
    app = await start_router(rep, http_max_connections=2, http_max_connections_per_peer=0, http_parser=parser,
                             http_header_timeout_s=60.0, http_idle_timeout_s=60.0)
    try:
        rep.hold = asyncio.Event()
        reader, writer = await connect(app)
        body = b'{"prompt": "slow", "max_tokens": 2}'
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" + b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\nconnection: close\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b'"redis_connected":false}'), READ_TIMEOUT_S)  # the first answer
        for _ in range(500):
            if rep.served:
                break
            await asyncio.sleep(0.01)
        idle_reader, idle_writer = await connect(app)  # 2 of 2
        await asyncio.sleep(0.05)
        status, _ = await send(app, b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")  # 3rd: room is made
        assert status == 200
        assert await asyncio.wait_for(idle_reader.read(), READ_TIMEOUT_S) == b""  # the idle one was closed
        rep.hold.set()
        rest = await read_until_closed(reader)
        assert rest.startswith(b"HTTP/1.1 200")  # the pipelined request was answered
        writer.close()
        idle_writer.close()
    finally:
        await app.stop(grace_s=0.2)
        await rep.stop()
