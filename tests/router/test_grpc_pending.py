"""A burst larger than grpc core's default pending-call limit (1000) is answered in full.

Before ``unicache.plumbing.grpc_server``, 2,000 concurrent streams into the router ended about 10%
CANCELLED by grpc core before the router saw them; the router's own overload answer
(RESOURCE_EXHAUSTED beyond ``max_in_flight``) never applied.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from unicache.plumbing.grpc_server import pending_call_options
from unicache.replica.serving.server import ReplicaServer
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

BURST = 2000


@pytest.fixture
async def router():
    fakes = [FakeReplica(f"r{i}") for i in range(4)]
    for f in fakes:
        await f.start()
    spec = ",".join(f"{f.replica_id}={f.address}" for f in fakes)
    app = RouterApp(build_config(env={}, overrides={"grpc_port": 0, "http_port": 0, "use_redis": False, "replicas": spec,
                                                    "routing_policy": "round_robin", "auth_enabled": False}))
    await app.start()
    try:
        yield app, fakes
    finally:
        await app.stop()
        for f in fakes:
            await f.stop()


@pytest.mark.timeout(300)
async def test_a_burst_beyond_cores_pending_limit_is_answered_in_full(router):
    app, fakes = router
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i: int) -> str:
            req = router_pb2.RouterGenerateRequest(text=f"burst {i}", sampling=common_pb2.SamplingParams(max_tokens=2))
            try:
                tokens = [t async for m in stub.Generate(req, timeout=240) for t in m.token_ids]
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK" if len(tokens) == 2 else f"{len(tokens)} tokens"

        outcomes = collections.Counter(await asyncio.gather(*(one(i) for i in range(BURST))))
    assert outcomes == {"OK": BURST}
    assert sum(len(f.served) for f in fakes) == BURST


def test_pending_limits_cover_what_the_application_admits():
    assert pending_call_options(4096) == [("grpc.server.max_pending_requests", 4096),
                                          ("grpc.server.max_pending_requests_hard_limit", 8192)]
    assert pending_call_options(10) == [("grpc.server.max_pending_requests", 1000),
                                        ("grpc.server.max_pending_requests_hard_limit", 2000)]  # core's default stays the floor
    assert pending_call_options(0)[0] == ("grpc.server.max_pending_requests", 1000)  # max_in_flight 0: refuse all, ourselves
    with pytest.raises(ValueError):
        pending_call_options(-1)
    server = ReplicaServer(engine=None, replica_id="r0", max_pending_calls=64 + 1024)
    assert ("grpc.server.max_pending_requests", 1088) in server._options
