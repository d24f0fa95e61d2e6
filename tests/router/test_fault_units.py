"""Fast, in-process checks of the fault handling the cluster tests exercise end to end
(tests/e2e/test_fault_cluster.py): the fault-injection hook, a mid-stream replica failure
surfacing as UNAVAILABLE, a missed deadline or a first-token stall quarantining the
replica, and session routing while the index is unavailable. The retry, quarantine and
timeout pieces one by one: tests/router/test_fault_retry.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.model_config import model_preset
from unicache.replica.serving.faults import FaultInjection
from unicache.replica.serving.server import ReplicaServer
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView, EmptyView
from unicache.router.config import build_config
from unicache.router.routing.base import RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc
from tests.support.engine_factory import tiny_config

PROMPT = "A prompt of exactly forty-eight bytes, 3 blocks."


# --- replica fault injection ------------------------------------------------------------
def test_fault_settings_default_off_and_model_presets():
    s = ReplicaSettings()
    assert (s.fault_first_token_delay_s, s.fault_token_delay_s) == (0.0, 0.0)
    assert s.faults() == FaultInjection(0.0, 0.0)
    assert s.engine_config().model == model_preset("default")
    tiny = ReplicaSettings(model_preset="tiny").engine_config().model
    assert (tiny.num_layers, tiny.hidden_size) == (2, 64)
    with pytest.raises(ValueError, match="unknown model preset 'huge'; known: default, tiny"):
        model_preset("huge")
    with pytest.raises(ValueError):
        FaultInjection(first_token_delay_s=-1)


async def test_first_token_delay_trips_the_callers_deadline_and_frees_nothing():
    engine = AsyncEngine(tiny_config())
    await engine.start()
    server = ReplicaServer(engine, "slow", faults=FaultInjection(first_token_delay_s=30.0))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = replica_pb2_grpc.ReplicaStub(ch)
            req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=list(range(20))))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Generate(req, timeout=0.3)]
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            server.servicer.faults = FaultInjection()  # turned off while running
            msgs = [m async for m in stub.Generate(req, timeout=30)]
            assert sum(len(m.token_ids) for m in msgs) == 16  # default_max_tokens
        assert engine.num_referenced_blocks() == 0
    finally:
        await server.stop()
        await engine.stop()


# --- router: failures on the way ---------------------------------------------------------
class DiesMidStream(FakeReplica):
    """Streams one token, then fails the call with UNAVAILABLE (as a killed process does)."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield replica_pb2.GenerateResponse(index=0, token_ids=[65], text="A")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")


class Stuck(FakeReplica):
    """Accepts the call and never answers (sets ``cancelled`` when the caller gives up)."""

    async def Generate(self, request, context):
        self.requests.append(request)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield replica_pb2.GenerateResponse()


async def start_router(reps, **overrides) -> tuple[RouterApp, router_pb2_grpc.RouterStub, grpc.aio.Channel]:
    spec = ",".join(f"{r.replica_id}={r.address}" for r in reps)
    cfg = build_config(
        env={"UNICACHE_USE_REDIS": "false"},
        overrides={"grpc_port": 0, "http_port": 0, "replicas": spec, "routing_policy": "round_robin", "auth_enabled": False, **overrides},
    )
    app = RouterApp(cfg)
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    return app, router_pb2_grpc.RouterStub(channel), channel


def gen_request(max_tokens: int = 4) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def test_replica_dying_mid_stream_is_unavailable_with_a_clear_message():
    rep = DiesMidStream("r0")
    await rep.start()
    app, stub, channel = await start_router([rep])
    try:
        call = stub.Generate(gen_request(), timeout=10)
        first = await call.read()
        assert (list(first.token_ids), first.route.replica_id) == ([65], "r0")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == (
            "replica r0 failed after the response started (UNAVAILABLE); the response is incomplete, retry the request"
        )
        assert not app.cluster.healthy("r0")  # quarantined until it answers a probe
        assert len(rep.served) == 1  # never retried after a token was sent
    finally:
        await channel.close()
        await app.stop()
        await rep.stop()


async def test_replica_dying_mid_sse_stream_ends_with_an_unavailable_error_event():
    rep = DiesMidStream("r0")
    await rep.start()
    app, _, channel = await start_router([rep])
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as client:
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
        assert resp.status_code == 200 and resp.headers["x-unicache-replica"] == "r0"
        events = [line[len("data: "):] for line in resp.text.split("\n\n") if line.startswith("data: ")]
        assert len(events) == 3 and events[-1] == "[DONE]"
        assert json.loads(events[0])["choices"][0]["text"] == "A"
        assert json.loads(events[1])["error"] == {
            "message": "replica r0 failed after the response started (UNAVAILABLE); the response is incomplete, retry the request",
            "type": "service_unavailable",
            "param": None,
            "code": "service_unavailable",
        }
    finally:
        await channel.close()
        await app.stop()
        await rep.stop()


async def test_missed_deadline_ends_the_request_and_quarantines_the_stuck_replica():
    stuck, good = Stuck("r0"), FakeReplica("r1")
    for r in (stuck, good):
        await r.start()
    # No first-token timeout: only the request's deadline (0.3 s, retries included) cuts it.
    app, stub, channel = await start_router([stuck, good], forward_deadline_s=0.3, first_token_timeout_s=0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Generate(gen_request(), timeout=10)]
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert info.value.details() == "no replica answered within the request's deadline (1 tried)"
        assert not app.cluster.healthy("r0") and app.cluster.healthy("r1")
        replies = []
        for _ in range(2):  # r0 is quarantined: the next requests go straight to r1
            msgs = [m async for m in stub.Generate(gen_request(), timeout=10)]
            replies.append((msgs[0].route.replica_id, "".join(m.text for m in msgs)))
        assert replies == [("r1", "A pr")] * 2
        assert (len(stuck.served), len(good.served)) == (1, 2)
    finally:
        await channel.close()
        await app.stop()
        for r in (stuck, good):
            await r.stop()


async def test_no_first_token_in_time_cancels_the_attempt_and_retries_elsewhere():
    stuck, good = Stuck("r0"), FakeReplica("r1")
    for r in (stuck, good):
        await r.start()
    # Nothing measured yet: the first-token timeout is its ceiling, 0.3 s.
    app, stub, channel = await start_router([stuck, good], forward_deadline_s=300.0, first_token_timeout_s=0.3)
    try:
        msgs = [m async for m in stub.Generate(gen_request(), timeout=10)]
        assert (msgs[0].route.replica_id, "".join(m.text for m in msgs)) == ("r1", "A pr")
        assert (len(stuck.served), len(good.served)) == (1, 1)
        await asyncio.wait_for(stuck.cancelled.wait(), 10)  # the stalled call was cancelled at the replica
        assert not app.cluster.healthy("r0")
        sample = app.metrics.registry.get_sample_value
        assert sample("unicache_router_retries_total") == 1
        assert sample("unicache_router_first_token_timeouts_total", {"replica": "r0"}) == 1
        assert sample("unicache_router_quarantines_total", {"replica": "r0"}) == 1
    finally:
        await channel.close()
        await app.stop()
        for r in (stuck, good):
            await r.stop()


def test_a_restarted_replica_is_not_quarantined_for_its_predecessors_refusals():
    now = [100.0]
    cluster = ClusterView(CacheAwarePolicy(), LocalityIndex(), clock=lambda: now[0])
    cluster.upsert("r0", "127.0.0.1:1000")
    assert cluster.quarantine("r0")
    cluster.upsert("r0", "127.0.0.1:1000")  # the old process's heartbeat, not yet expired
    assert not cluster.healthy("r0")
    cluster.upsert("r0", "127.0.0.1:2000")  # restarted on a new port
    assert cluster.healthy("r0") and cluster.replicas["r0"].address == "127.0.0.1:2000"


# --- routing while Redis is down ------------------------------------------------------------
def test_sessions_stick_while_the_index_is_unavailable():
    # NOTE: no churn term: after one request its inflow share alone would outweigh the
    # sticky credit; the cluster test shows stickiness under the default policy.
    policy = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0))
    cluster = ClusterView(policy, LocalityIndex())
    for rid in ("r0", "r1", "r2"):
        cluster.upsert(rid, f"127.0.0.1:{rid}")
    cluster.redis_connected = False
    view = cluster.locality()
    assert isinstance(view, EmptyView) and view.is_stale("r1") and view.match("r1", []) == 0

    def request(text: str, rid: str) -> RoutingRequest:
        ids = list(text.encode())
        cls = RequestClass(tenant="t", session_id="s1", turn=1, task=Task.CHAT)
        return RoutingRequest(rid, cls, hash_token_blocks(ids, 16), len(ids), 16)

    turn1 = request(PROMPT * 2, "q1")
    d1 = policy.choose(turn1, cluster.loads(), view)
    policy.on_request_routed(turn1, d1)
    policy.on_request_finished(turn1, d1.replica_id)
    turn2 = request(PROMPT * 2 + " and the next turn of the same session", "q2")
    d2 = policy.choose(turn2, cluster.loads(), view)
    assert (d1.reason, d2.replica_id, d2.reason, d2.matched_blocks) == ("load", d1.replica_id, "session_sticky", 3)
