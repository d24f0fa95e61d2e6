"""The framed replica hop (unicache/contract/hop.py): the replica's ``HopServer`` and the router's
``HopClient`` against the real engine with a tiny seeded model.

The hop must be indistinguishable from gRPC to the request path: the same messages, the
same status codes, details and refusal metadata, cancellation and deadlines that free the
request's blocks; and it must refuse anyone without the cluster key, in both directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest

from unicache.contract import hop
from unicache.contract.state_auth import CallCredential
from unicache.contract.wire import REFUSAL_METADATA
from unicache.replica.serving.faults import FaultInjection
from unicache.replica.serving.server import ReplicaServer
from unicache.router.upstream.hop_client import HopClient, HopStream
from unicache.router.upstream.replica_client import GrpcReplicaStream, ReplicaClients
from unicache.testing.polling import eventually

from tests.replica.test_replica_server import PROMPT, direct, engine, make_request, no_blocks_referenced  # noqa: F401 - engine: a fixture

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


async def serve(engine, key=KEY, replica_id="r0", **kw) -> ReplicaServer:
    server = ReplicaServer(engine, replica_id, port=0, grace_s=0.5, cluster_key=key, hop_port=0, **kw)
    await server.start()
    return server


@pytest.fixture
async def served(engine):
    server = await serve(engine)
    clients = ReplicaClients(credential=CallCredential(KEY), cluster_key=KEY)
    yield engine, server, clients
    await clients.close()
    await server.stop()


def addresses(server: ReplicaServer) -> tuple[str, str]:
    return f"127.0.0.1:{server.port}", f"127.0.0.1:{server.hop_port}"


def fields(msg) -> tuple:
    u = msg.usage
    return (msg.index, list(msg.token_ids), msg.text, msg.finish_reason, msg.HasField("usage"), u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def content(msgs) -> tuple:
    """What a stream says, independent of how its tokens were split into messages (the
    router's hop stream hands on as one message the tokens that queued before it was read,
    as timing falls; gRPC's stream passes each message on):
    the tokens and text in order, each message's choice index, whether a message before the
    last carries a finish reason or usage, and the last message's fields."""
    return (
        tokens(msgs),
        "".join(m.text for m in msgs),
        {m.index for m in msgs},
        any(m.finish_reason or m.HasField("usage") for m in msgs[:-1]),
        fields(msgs[-1])[3:],
    )


def tokens(msgs) -> list[int]:
    """The token ids of a stream's messages, in order (a router's hop stream hands on as one
    message what queued before it was read, so a message may carry several)."""
    return [t for m in msgs for t in m.token_ids]


async def collect(stream) -> list:
    msgs = []
    try:
        first = await stream.first()
        if first is None:
            return msgs
        msgs.append(first)
        while (msg := await stream.next()) is not None:
            msgs.append(msg)
        return msgs
    finally:
        stream.close()


@contextlib.asynccontextmanager
async def served_hop(engine, **kw):
    """(a replica server with its hop, a hop client of it holding the key), both closed after."""
    server = await serve(engine, **kw)
    client = HopClient(addresses(server)[1], "r0", hop.HopAuth(KEY))
    try:
        yield server, client
    finally:
        client.close()
        await server.stop()


async def streams_ended(server: ReplicaServer) -> None:
    """Until the replica's hop has no stream open (cancellations reach it asynchronously)."""
    await eventually(lambda: not any(c.streams for c in server.hop.connections), "the replica's hop streams to end", timeout_s=10)


async def failure(stream) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stream)
    return err.value


# ------------------------------------------------------------------ the same stream as gRPC
async def test_hop_streams_exactly_what_grpc_streams(served):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    await direct(engine, PROMPT, max_tokens=6)  # cache the prompt so both runs hit alike
    via_grpc = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=6), 30)
    via_hop = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=6), 30, hop_addr, "r0")
    assert isinstance(via_grpc, GrpcReplicaStream) and isinstance(via_hop, HopStream)
    a, b = await collect(via_grpc), await collect(via_hop)
    assert content(b) == content(a)  # all but the measured times and message boundaries
    assert len(tokens(b)) == 6 and b[-1].usage.cached_tokens == 8
    assert await no_blocks_referenced(engine)


async def test_streams_share_one_connection(served):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    prompts = [[p + i for p in PROMPT] for i in range(8)]
    want = [await collect(clients.generate(grpc_addr, make_request(p, max_tokens=4), 30)) for p in prompts]
    got = await asyncio.gather(*(collect(clients.generate(grpc_addr, make_request(p, max_tokens=4), 30, hop_addr, "r0")) for p in prompts))
    assert [tokens(ms) for ms in got] == [tokens(ms) for ms in want]
    assert clients.hop(hop_addr, "r0").connects == 1
    assert len(server.hop.connections) == 1


async def test_transport_grpc_never_uses_the_hop(served):
    engine, server, _ = served
    grpc_addr, hop_addr = addresses(server)
    clients = ReplicaClients(credential=CallCredential(KEY), cluster_key=KEY, transport="grpc")
    try:
        stream = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=2), 30, hop_addr, "r0")
        assert isinstance(stream, GrpcReplicaStream)
        assert len(tokens(await collect(stream))) == 2
        assert not server.hop.connections
    finally:
        await clients.close()
    with pytest.raises(ValueError, match="transport"):
        ReplicaClients(transport="tcp")


# ------------------------------------------------------------------ statuses as gRPC's
@pytest.mark.parametrize(
    "request_, code, refusal",
    [
        (make_request(), grpc.StatusCode.INVALID_ARGUMENT, None),
        (make_request([1, 2, 100_000]), grpc.StatusCode.INVALID_ARGUMENT, None),
        (make_request(list(range(250)), max_tokens=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
        (make_request(list(range(130)), max_tokens=1), grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
    ],
    ids=["missing", "bad-token", "too-long", "bigger-than-cache"],
)
async def test_errors_match_grpc_code_details_and_refusal(served, request_, code, refusal):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    a = await failure(clients.generate(grpc_addr, request_, 30))
    b = await failure(clients.generate(grpc_addr, request_, 30, hop_addr, "r0"))
    assert (b.code(), b.details()) == (a.code(), a.details()) == (code, a.details())
    assert dict(b.trailing_metadata() or ()).get(REFUSAL_METADATA) == dict(a.trailing_metadata() or ()).get(REFUSAL_METADATA) == refusal
    assert await no_blocks_referenced(engine)


async def test_closing_midway_cancels_at_the_replica_and_frees_blocks(served):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    stream = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=100), 30, hop_addr, "r0")
    first = await stream.first()
    # the hop hands on as one message what queued before it was read: the first may carry more
    # than one token, but closing must come before the request's end
    assert 1 <= len(first.token_ids) < 100 and not first.finish_reason
    stream.close()
    assert await no_blocks_referenced(engine)
    await streams_ended(server)
    await eventually(lambda: engine.load().running == 0, "the engine to drop the request")
    # the connection survives a cancelled stream
    assert len(tokens(await collect(clients.generate(grpc_addr, make_request(PROMPT, max_tokens=2), 30, hop_addr, "r0")))) == 2
    assert clients.hop(hop_addr, "r0").connects == 1


async def test_deadline_ends_the_stream_on_both_sides(engine):
    async with served_hop(engine, faults=FaultInjection(first_token_delay_s=2.0)) as (server, client):
        err = await failure(client.stream(make_request(PROMPT, max_tokens=3), 0.2))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await streams_ended(server)
        assert await no_blocks_referenced(engine)


async def test_first_token_timeout_cancels_a_silent_replica(engine):
    async with served_hop(engine, faults=FaultInjection(first_token_delay_s=2.0)) as (server, client):
        stream = client.stream(make_request(PROMPT, max_tokens=3), 30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.first(0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and stream.timed_out
        await streams_ended(server)


async def test_stream_limit_refuses_as_overloaded(engine):
    async with served_hop(engine, max_pending_calls=1) as (server, client):
        first = client.stream(make_request(PROMPT, max_tokens=50), 30)
        assert await first.first() is not None
        err = await failure(client.stream(make_request(PROMPT, max_tokens=2), 30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.trailing_metadata()).get(REFUSAL_METADATA) == "overloaded"
        first.close()


async def test_lost_connection_fails_open_streams_unavailable_then_reconnects(served):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    stream = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=100), 30, hop_addr, "r0")
    assert await stream.first() is not None
    for conn in list(server.hop.connections):
        conn.close()
    err = await failure(stream)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert await no_blocks_referenced(engine)
    assert len(tokens(await collect(clients.generate(grpc_addr, make_request(PROMPT, max_tokens=2), 30, hop_addr, "r0")))) == 2
    assert clients.hop(hop_addr, "r0").connects == 2


async def test_nothing_listening_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HopClient(f"127.0.0.1:{port}", "r0", hop.HopAuth(KEY))
    err = await failure(client.stream(make_request(PROMPT), 5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ authentication
@pytest.mark.parametrize(
    "server_key, client_key, replica_id, code, fragment",
    [
        (KEY, OTHER_KEY, "r0", grpc.StatusCode.UNAUTHENTICATED, "invalid cluster credential"),
        (KEY, None, "r0", grpc.StatusCode.UNAUTHENTICATED, "this router has no cluster key"),
        (None, KEY, "r0", grpc.StatusCode.UNAUTHENTICATED, "cannot prove who it is"),
        (KEY, KEY, "r1", grpc.StatusCode.UNAVAILABLE, "not 'r1'"),
    ],
    ids=["wrong-key", "router-without-key", "replica-without-key", "wrong-replica"],
)
async def test_handshake_refusals(engine, server_key, client_key, replica_id, code, fragment):
    server = await serve(engine, key=server_key)
    client = HopClient(addresses(server)[1], replica_id, hop.HopAuth(client_key) if client_key else None)
    try:
        err = await failure(client.stream(make_request(PROMPT, max_tokens=2), 5))
        assert err.code() == code and fragment in err.details(), err.details()
        assert engine.load().running == 0 and client.connects == 0
        assert server.hop.refused == (1 if client_key == OTHER_KEY else 0)
    finally:
        client.close()
        await server.stop()


async def test_no_key_on_either_side_still_checks_the_replica_id(engine):
    server = await serve(engine, key=None)
    try:
        ok = HopClient(addresses(server)[1], "r0", None)
        assert len(tokens(await collect(ok.stream(make_request(PROMPT, max_tokens=2), 5)))) == 2
        ok.close()
    finally:
        await server.stop()


async def raw_connection(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    kind, sid, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
    assert (kind, sid) == (hop.HELLO, 0)
    return reader, writer, await reader.readexactly(n)


async def test_requests_before_the_handshake_are_never_read(engine):
    server = await serve(engine)
    try:
        reader, writer, _ = await raw_connection(server.hop_port)
        body = make_request(PROMPT, max_tokens=5).SerializeToString()
        writer.write(hop.frame(hop.REQUEST, 1, hop.DEADLINE.pack(0) + body))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
        assert engine.load().running == 0 and await no_blocks_referenced(engine)
        writer.close()
    finally:
        await server.stop()


async def test_oversized_or_unknown_frames_close_the_connection(engine):
    server = await serve(engine, key=None)
    try:
        # before the handshake: AUTH is at most nonce + proof bytes
        reader, writer, _ = await raw_connection(server.hop_port)
        writer.write(hop.HEADER.pack(hop.AUTH, 0, 1 << 20))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # after it: an unknown kind
        reader, writer, _ = await raw_connection(server.hop_port)
        writer.write(hop.frame(hop.AUTH, 0, hop.new_nonce()))
        kind, _, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
        assert (kind, n) == (hop.WELCOME, 0)
        writer.write(hop.frame(99, 1, b""))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await server.stop()


async def test_a_squatter_without_the_key_cannot_pass_as_the_replica():
    """A process on the advertised port that answers the handshake with a made-up proof:
    the router refuses it before sending any request."""
    seen: list[int] = []

    async def squat(reader, writer):
        writer.write(hop.frame(hop.HELLO, 0, hop.hello_payload(hop.FLAG_AUTH, hop.new_nonce(), "r0")))
        kind, _, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
        await reader.readexactly(n)
        writer.write(hop.frame(hop.WELCOME, 0, bytes(32)))
        try:
            while True:
                kind, _, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
                await reader.readexactly(n)
                seen.append(kind)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    squatter = await asyncio.start_server(squat, "127.0.0.1", 0)
    client = HopClient(f"127.0.0.1:{squatter.sockets[0].getsockname()[1]}", "r0", hop.HopAuth(KEY))
    try:
        err = await failure(client.stream(make_request(PROMPT, max_tokens=2), 5))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "failed to prove" in err.details()
        await asyncio.sleep(0.1)
        assert hop.REQUEST not in seen
    finally:
        client.close()
        squatter.close()


# ------------------------------------------------------------------ framing
def test_frame_parser_reassembles_frames_split_anywhere():
    frames = [(hop.MESSAGE, 1, b"abc"), (hop.END, 1, b""), (hop.ERROR, 7, hop.encode_status(grpc.StatusCode.INTERNAL, "x", ""))]
    data = b"".join(hop.frame(*f) for f in frames)
    for cut in range(len(data) + 1):
        got: list = []
        parser = hop.FrameParser(lambda k, s, p: got.append((k, s, p)), 64)
        parser.feed(data[:cut])
        parser.feed(data[cut:])
        assert got == frames
    with pytest.raises(hop.HopProtocolError):
        hop.FrameParser(lambda *a: None, 2).feed(hop.frame(hop.MESSAGE, 1, b"abc"))


def test_status_round_trips_every_code_and_refusal():
    for code in grpc.StatusCode:
        for refusal in hop.REFUSALS:
            assert hop.decode_status(hop.encode_status(code, "d\u00e9tails", refusal)) == (code, "d\u00e9tails", refusal)
    assert hop.decode_status(b"\x07") == (grpc.StatusCode.UNKNOWN, "malformed hop status", "")
    assert hop.decode_status(bytes((200, 9))) == (grpc.StatusCode.UNKNOWN, "", "")


async def test_a_replica_leaving_keeps_its_open_streams_then_closes(served):
    """Its heartbeat expired: requests under way end as on gRPC, then the connection goes."""
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    stream = clients.generate(grpc_addr, make_request(PROMPT, max_tokens=6), 30, hop_addr, "r0")
    assert (first := await stream.first()) is not None
    conn = clients.hop(hop_addr, "r0")._conn
    clients.forget_replica("r0")
    assert conn.usable and "r0" not in clients._hops
    rest = []
    while (msg := await stream.next()) is not None:
        rest.append(msg)
    assert len(tokens([first, *rest])) == 6 and rest[-1].finish_reason == 1
    assert not conn.usable


# ------------------------------------------------------------------ live: heartbeat -> router -> hop
async def test_router_reaches_replicas_over_their_advertised_hop():
    """Whole replicas advertise their hop in their signed heartbeats; the router sends
    every request (and nothing else) over it, HTTP and gRPC front doors alike."""
    from unicache.testing.dashboard_stack import DashboardStack
    from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

    st = await DashboardStack.start(num_replicas=2)
    try:
        for rt in st.replicas:
            hb = st.app.cluster.replicas[rt.settings.replica_id].heartbeat
            assert hb.hop_address == rt.hop_address == f"127.0.0.1:{rt.server.hop_port}"
        texts = [(await st.complete(f"prompt number {i}: " + "x" * 40)).json()["choices"][0]["text"] for i in range(4)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{st.app.grpc_port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.RouterGenerateRequest(text="prompt number 0: " + "x" * 40, sampling=common_pb2.SamplingParams(max_tokens=4))
            msgs = [m async for m in stub.Generate(req, timeout=60, metadata=(("x-api-key", "dash-key"),))]
        assert sum(len(m.token_ids) for m in msgs) == 4 and all(len(t) == 4 for t in texts)
        hops = st.app.clients._hops
        assert sorted(hops) == ["replica-0", "replica-1"] and all(c.connects == 1 for c in hops.values())
        assert sum(len(rt.server.hop.connections) for rt in st.replicas) == 2
        assert sum(rt.server.hop.streams for rt in st.replicas) == 5  # every request, over the hop
        state = (await st.client.get("/v1/cluster/state")).json()
        assert sorted(r["info"]["hop_address"] for r in state["replicas"]) == sorted(rt.hop_address for rt in st.replicas)
    finally:
        await st.close()


async def test_a_replica_on_a_new_hop_address_retires_the_old_one(served):
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    assert len(tokens(await collect(clients.generate(grpc_addr, make_request(PROMPT, max_tokens=2), 30, hop_addr, "r0")))) == 2
    old = clients.hop(hop_addr, "r0")._conn
    moved = await serve(engine)  # the same replica id, restarted on new ports
    try:
        new_grpc, new_hop = addresses(moved)
        assert len(tokens(await collect(clients.generate(new_grpc, make_request(PROMPT, max_tokens=2), 30, new_hop, "r0")))) == 2
        assert [(c.address, rid) for rid, c in clients._hops.items()] == [(new_hop, "r0")] and not old.usable
    finally:
        await moved.stop()


async def test_stopping_finishes_running_streams_and_refuses_new_ones_unavailable(engine):
    async with served_hop(engine, faults=FaultInjection(token_delay_s=0.05)) as (server, client):
        running = client.stream(make_request(PROMPT, max_tokens=6), 30)
        assert (first := await running.first()) is not None
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0.01)
        err = await failure(client.stream(make_request(PROMPT, max_tokens=2), 30))
        assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
        rest = []
        while (msg := await running.next()) is not None:
            rest.append(msg)
        assert len(tokens([first, *rest])) == 6  # finished within the grace period
        await stopping


async def test_both_ends_of_a_hop_connection_keep_tcp_alive(served):
    """A replica that vanishes without closing its connection is found by TCP keepalive."""
    engine, server, clients = served
    grpc_addr, hop_addr = addresses(server)
    assert len(tokens(await collect(clients.generate(grpc_addr, make_request(PROMPT, max_tokens=2), 30, hop_addr, "r0")))) == 2
    ends = [clients.hop(hop_addr, "r0")._conn.transport, *(c.transport for c in server.hop.connections)]
    assert len(ends) == 2
    for transport in ends:
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == hop.KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1  # asyncio's default, kept


async def test_connection_outcomes_are_counted(engine):
    from prometheus_client import CollectorRegistry, Counter

    counter = Counter("hop_connections", "test", ["outcome"], registry=CollectorRegistry())
    counts = lambda: {o: counter.labels(o)._value.get() for o in ("connected", "refused", "unreachable", "lost")}  # noqa: E731
    server = await serve(engine)
    try:
        ok = HopClient(addresses(server)[1], "r0", hop.HopAuth(KEY), counter=counter)
        assert len(tokens(await collect(ok.stream(make_request(PROMPT, max_tokens=2), 5)))) == 2
        for conn in list(server.hop.connections):
            conn.close()  # the replica side drops it
        await eventually(lambda: counts()["lost"] == 1, "the drop to be counted")
        wrong = HopClient(addresses(server)[1], "r0", hop.HopAuth(OTHER_KEY), counter=counter)
        await failure(wrong.stream(make_request(PROMPT, max_tokens=2), 5))
        assert len(tokens(await collect(ok.stream(make_request(PROMPT, max_tokens=2), 5)))) == 2  # reconnects
        ok.close()  # closed by this side: not "lost"
    finally:
        await server.stop()
    gone = HopClient(addresses(server)[1], "r0", hop.HopAuth(KEY), counter=counter)
    await failure(gone.stream(make_request(PROMPT), 5))
    assert counts() == {"connected": 2, "refused": 1, "unreachable": 1, "lost": 1}
