"""A replica that fails authentication (a hop handshake that fails, a peer at its address
that is another replica or no replica, a refused cluster credential on gRPC) is a replica
failure (issue 39): the router quarantines it and retries elsewhere within the request's
deadline, so no client sees a 502 for it.

Two fake replicas on static addresses behind a round-robin router with a cluster key;
r1's address is taken over (or misconfigured) in each case, r0 is genuine.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from unicache.contract import hop
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.signed_state import CLUSTER_KEY, parse_cluster_key

KEY = parse_cluster_key(CLUSTER_KEY)
OTHER_KEY = bytes(range(1, 33))
REQUESTS = 10


async def squatter_proving_nothing() -> tuple[asyncio.Server, str, list[int]]:
    """A process on r1's hop port that claims to be r1 with a made-up proof; records the
    frame kinds it receives after the handshake."""
    seen: list[int] = []

    async def squat(reader, writer):
        writer.write(hop.frame(hop.HELLO, 0, hop.hello_payload(hop.FLAG_AUTH, hop.new_nonce(), "r1")))
        try:
            _, _, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
            await reader.readexactly(n)
            writer.write(hop.frame(hop.WELCOME, 0, bytes(32)))
            while True:
                kind, _, n = hop.HEADER.unpack(await reader.readexactly(hop.HEADER_BYTES))
                await reader.readexactly(n)
                seen.append(kind)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(squat, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


@pytest.mark.parametrize("case", ["hop_squatter_bad_proof", "hop_replica_with_another_key", "hop_peer_is_another_replica", "grpc_refuses_credential"])
async def test_a_replica_failing_authentication_is_retried_elsewhere(case):
    r0, r1 = FakeReplica("r0"), FakeReplica("r1")
    await r0.start(hop=True, cluster_key=KEY)
    await r1.start(hop=case != "grpc_refuses_credential", cluster_key=OTHER_KEY if case == "hop_replica_with_another_key" else KEY)
    squatter = seen = None
    transport = "grpc" if case.startswith("grpc") else "auto"
    if case == "hop_squatter_bad_proof":
        squatter, r1_hop, seen = await squatter_proving_nothing()
    elif case == "hop_peer_is_another_replica":
        r1_hop = f"127.0.0.1:{r0.hop.port}"  # r0 answers at the address r1 advertised
    elif case == "hop_replica_with_another_key":
        r1_hop = f"127.0.0.1:{r1.hop.port}"
    else:
        r1_hop = ""
        r1.fail_next, r1.fail_code = 1000, grpc.StatusCode.UNAUTHENTICATED  # as a replica refusing the credential
    replicas = f"r0={r0.address}@127.0.0.1:{r0.hop.port}," + (f"r1={r1.address}@{r1_hop}" if r1_hop else f"r1={r1.address}")
    cfg = build_config(
        env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False, "replicas": replicas,
                   "routing_policy": "round_robin", "replica_transport": transport},
    )
    app = RouterApp(cfg)
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as client:
            answers = []
            for i in range(REQUESTS):
                r = await client.post("/v1/completions", json={"prompt": f"secret prompt {i}", "max_tokens": 2})
                answers.append((r.status_code, r.headers.get("x-unicache-replica")))
        assert answers == [(200, "r0")] * REQUESTS
        assert app.cluster.replicas["r1"].quarantined
        assert app.metrics.retries._value.get() >= 1
        # r1 saw a request only where it is the genuine replica refusing the call (gRPC)
        assert (len(r0.served), len(r1.served)) == (REQUESTS, 1 if case == "grpc_refuses_credential" else 0)
        if seen is not None:
            assert hop.REQUEST not in seen  # the squatter got no prompt
    finally:
        await app.stop()
        await r0.stop()
        await r1.stop()
        if squatter is not None:
            squatter.close()


async def test_a_hop_peer_that_never_answers_holds_a_stream_no_longer_than_its_deadline():
    """A process that accepts the connection and stays silent (no handshake): the stream
    ends DEADLINE_EXCEEDED at its own deadline, not at the connect timeout (5 s here)."""
    from unicache.router.upstream.hop_client import HopClient
    from unicache.v1 import common_pb2, replica_pb2

    accepted = asyncio.Event()

    async def silent(reader, writer):
        accepted.set()
        await reader.read()  # never answers; ends when the router closes

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = HopClient(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", "r1", hop.HopAuth(KEY), connect_timeout_s=30.0)
    request = replica_pb2.GenerateRequest(request_id="x", text="hi", sampling=common_pb2.SamplingParams(max_tokens=1))
    try:
        stream = client.stream(request, 0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.first()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and accepted.is_set()
        assert stream.timed_out is False  # the call's deadline, not a first-token timeout
    finally:
        client.close()
        server.close()
