"""The request path's failure handling piece by piece: derived first-token timeouts,
quarantine and re-probing on a fake clock, bounded JSON depth, metric series of departed
replicas, client errors without addresses, and the gRPC error table. End to end with
real replicas: tests/e2e/test_fault_cluster.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import httpx
import pytest

from unicache.contract.chat_template import ChatFormatError
from unicache.router.app import RouterApp
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.prober import QuarantineProber
from unicache.router.cluster.view import ClusterView
from unicache.router.config import build_config
from unicache.router.frontends.grpc_service import grpc_status
from unicache.router.frontends.json_input import JsonInputError, json_depth_exceeds, loads_bounded
from unicache.router.request_path.auth import AuthError
from unicache.router.request_path.core import RouterError
from unicache.router.request_path.first_token import FirstTokenTimeout
from unicache.router.routing.baselines.round_robin import RoundRobinPolicy
from unicache.router.upstream.replica_client import GrpcReplicaStream
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc


# --- derived first-token timeout ------------------------------------------------------------
def test_derived_timeout_is_a_multiple_of_mean_plus_four_deviations_within_floor_and_ceiling():
    ftt = FirstTokenTimeout(ceiling_s=60.0, floor_s=0.1, multiplier=3.0, min_samples=5)
    for _ in range(5):
        ftt.observe("r0", 0.1)
    est = ftt.estimate("r0")
    # First sample: mean 0.1, deviation 0.05; four equal samples shrink it by (3/4)^4.
    assert (est.samples, est.mean) == (5, pytest.approx(0.1))
    assert est.dev == pytest.approx(0.05 * 0.75**4)
    assert ftt.timeout_s("r0") == pytest.approx(3.0 * (0.1 + 4 * 0.05 * 0.75**4))  # 0.4898
    assert FirstTokenTimeout(60.0, floor_s=2.0, multiplier=3.0) is not None
    floored = FirstTokenTimeout(ceiling_s=60.0, floor_s=2.0)
    for _ in range(5):
        floored.observe("r0", 0.1)
    assert floored.timeout_s("r0") == 2.0
    capped = FirstTokenTimeout(ceiling_s=5.0, floor_s=2.0)
    for _ in range(5):
        capped.observe("r0", 10.0)
    assert capped.timeout_s("r0") == 5.0
    assert FirstTokenTimeout(ceiling_s=0.3, floor_s=2.0).floor_s == 0.3  # the floor never exceeds the ceiling


def test_cold_replicas_use_the_cluster_estimate_then_the_ceiling():
    ftt = FirstTokenTimeout(ceiling_s=60.0, floor_s=0.0, multiplier=1.0, min_samples=2)
    assert ftt.timeout_s("r0") == 60.0  # nothing measured anywhere
    ftt.observe("r0", 1.0)
    assert ftt.timeout_s("r0") == 60.0  # one sample is not enough
    ftt.observe("r0", 1.0)
    # r0: mean 1.0, dev 0.5 * 3/4 = 0.375 -> 1 + 4 * 0.375 = 2.5; r1 (unmeasured) gets the cluster's.
    assert (ftt.timeout_s("r0"), ftt.timeout_s("r1")) == (pytest.approx(2.5), pytest.approx(2.5))
    ftt.forget("r0")
    assert ftt.estimate("r0") is None and ftt.timeout_s("r0") == pytest.approx(2.5)


def test_a_timeout_doubles_the_next_one_until_a_first_token_is_measured():
    ftt = FirstTokenTimeout(ceiling_s=10.0, floor_s=1.0, multiplier=1.0, min_samples=1)
    ftt.observe("r0", 0.5)  # mean 0.5, dev 0.25 -> 1.5
    assert ftt.timeout_s("r0") == pytest.approx(1.5)
    ftt.timed_out("r0")
    ftt.timed_out("r0")
    assert ftt.timeout_s("r0") == pytest.approx(6.0)
    ftt.timed_out("r0")
    assert ftt.timeout_s("r0") == 10.0  # the ceiling bounds the backoff
    ftt.observe("r0", 0.5)  # a measured first token ends the backoff
    assert ftt.timeout_s("r0") == pytest.approx(0.5 + 4 * (0.25 + 0.25 * (0.0 - 0.25)))


# --- quarantine and re-probing on a fake clock ------------------------------------------------
class FakeProbes:
    """Stands in for ReplicaClients.probe: answers per address from a script."""

    def __init__(self):
        self.up: dict[str, bool] = {}
        self.calls: list[tuple[str, float]] = []

    async def probe(self, address: str, timeout_s: float, hop_address: str = "", replica_id: str = "") -> None:
        self.calls.append((address, timeout_s))
        if not self.up.get(address, False):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")


async def test_quarantine_probes_with_bounded_exponential_backoff_until_the_replica_answers():
    now = [0.0]
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex(), quarantine_initial_s=0.5, quarantine_max_s=3.0, clock=lambda: now[0])
    for rid in ("r0", "r1"):
        cluster.upsert(rid, f"addr-{rid}")
    probes = FakeProbes()
    prober = QuarantineProber(cluster, probes, timeout_for=lambda rid: 2.0)
    assert cluster.quarantine("r0") and not cluster.quarantine("r0")  # once; its schedule stays
    assert [load.replica_id for load in cluster.loads()] == ["r1"]
    assert [load.replica_id for load in cluster.loads(quarantined=True)] == ["r0"]
    probe_times = []
    while now[0] < 12.0:  # the replica stays down: probes at 0.5, then +1, +2, +3, +3, ...
        if await prober.probe_due():
            probe_times.append(now[0])
        now[0] = round(now[0] + 0.25, 2)
    assert probe_times == [0.5, 1.5, 3.5, 6.5, 9.5]
    assert probes.calls == [("addr-r0", 2.0)] * 5
    probes.up["addr-r0"] = True
    now[0] = 12.5
    assert await prober.probe_due() == {"r0": True}
    assert cluster.healthy("r0") and cluster.next_probe_at() is None
    # Quarantined again later: the backoff starts over from quarantine_initial_s.
    cluster.quarantine("r0")
    assert cluster.next_probe_at() == 13.0


async def test_the_prober_sleeps_until_a_quarantine_wakes_it():
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex(), quarantine_initial_s=0.05)
    cluster.upsert("r0", "addr-r0")
    probes = FakeProbes()
    probes.up["addr-r0"] = True
    prober = QuarantineProber(cluster, probes, timeout_for=lambda rid: 1.0, tick_s=3600.0)  # a tick never ends it
    task = asyncio.create_task(prober.run())
    await asyncio.sleep(0.2)
    assert probes.calls == [] and len(cluster.on_quarantine) == 1  # asleep, nothing probed
    assert cluster.quarantine("r0")
    for _ in range(100):
        if cluster.healthy("r0"):
            break
        await asyncio.sleep(0.05)
    assert cluster.healthy("r0") and probes.calls == [("addr-r0", 1.0)]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cluster.on_quarantine == []  # a stopped prober leaves no wake-up behind


async def test_a_probe_result_for_an_old_address_is_ignored():
    now = [0.0]
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex(), clock=lambda: now[0])
    cluster.upsert("r0", "old")
    cluster.quarantine("r0")
    now[0] = 1.0
    due = cluster.probes_due()
    cluster.upsert("r0", "new")  # restarted while the probe was out
    cluster.quarantine("r0")  # and the new process refused too
    prober = QuarantineProber(cluster, FakeProbes(), timeout_for=lambda rid: 1.0)
    assert due == [("r0", "old")] and await prober.probe_due() == {}  # not due yet for "new"
    assert not cluster.healthy("r0")


# --- JSON depth ----------------------------------------------------------------------------------
def test_loads_bounded_refuses_deep_nesting_before_parsing():
    assert loads_bounded('{"a": [[1, 2], {"b": "c"}]}') == {"a": [[1, 2], {"b": "c"}]}
    assert loads_bounded(b"[" * 64 + b"]" * 64, max_depth=64) == json.loads("[" * 64 + "]" * 64)
    with pytest.raises(JsonInputError, match="^chat_json nests arrays or objects deeper than 64 levels$"):
        loads_bounded("[" * 65 + "]" * 65, "chat_json")
    with pytest.raises(JsonInputError, match="^request body nests arrays or objects deeper than 64 levels$"):
        loads_bounded(b"[" * 100_000)
    # Brackets inside strings (escaped quotes too) do not count; siblings do not add up.
    assert not json_depth_exceeds('["' + "[" * 100 + '\\"[["]', 2)
    assert not json_depth_exceeds("[" + "[]," * 100 + "[]]", 2)
    assert json_depth_exceeds("[[[]]]", 2)
    with pytest.raises(JsonInputError, match=r"^request body is not valid JSON \(line 1, column 2\)$"):
        loads_bounded("{")
    with pytest.raises(JsonInputError, match="^request body is not valid JSON$"):
        loads_bounded(b"\xff\xfe{")


# --- the gRPC front door ------------------------------------------------------------------------
def test_grpc_status_is_one_table_for_every_error():
    assert grpc_status(RouterError("overloaded", "busy")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", "overloaded")
    assert grpc_status(AuthError("bad key")) == (grpc.StatusCode.UNAUTHENTICATED, "bad key", "unauthenticated")
    assert grpc_status(ChatFormatError("bad chat")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad chat", "invalid")
    assert grpc_status(KeyError("secret detail")) == (grpc.StatusCode.INTERNAL, "internal router error", "error")


def dead_address() -> str:
    """A loopback address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def start_router(spec: str, **overrides) -> tuple[RouterApp, router_pb2_grpc.RouterStub, grpc.aio.Channel]:
    cfg = build_config(
        env={"UNICACHE_USE_REDIS": "false"},
        overrides={"grpc_port": 0, "http_port": 0, "replicas": spec, "routing_policy": "round_robin", "auth_enabled": False, **overrides},
    )
    app = RouterApp(cfg)
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    return app, router_pb2_grpc.RouterStub(channel), channel


async def test_chat_json_nested_100000_deep_is_invalid_argument():
    rep = FakeReplica("r0")
    await rep.start()
    app, stub, channel = await start_router(f"r0={rep.address}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(chat_json="[" * 100_000), timeout=10)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "chat_json nests arrays or objects deeper than 64 levels"
        chat = json.dumps([{"role": "user", "content": "hi"}])
        msgs = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(chat_json=chat), timeout=10)]
        assert msgs[0].route.replica_id == "r0" and rep.served[0].token_ids.ids == list(b"<|user|>\nhi\n<|assistant|>\n")
        assert app.metrics.registry.get_sample_value("unicache_router_requests_total", {"api": "grpc", "outcome": "invalid"}) == 1
    finally:
        await channel.close()
        await app.stop()
        await rep.stop()


async def test_client_errors_name_no_replica_address_and_a_refuser_costs_one_attempt():
    dead = dead_address()
    good = FakeReplica("r1")
    await good.start()
    app, stub, channel = await start_router(f"r0={dead},r1={good.address}")
    host, port = dead.rsplit(":", 1)
    try:
        # r0 refuses the connection: quarantined, the request retried on r1.
        msgs = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text="hello"), timeout=10)]
        assert msgs[0].route.replica_id == "r1" and not app.cluster.healthy("r0")
        # Only the dead replica left: the client's error says "unavailable", nothing more.
        app.cluster.remove("r1")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text="hello"), timeout=10)]
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "replica unavailable")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as client:
            resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["message"] == "replica unavailable"
        for text in (info.value.details(), resp.text):
            assert host not in text and port not in text
    finally:
        await channel.close()
        await app.stop()
        await good.stop()


async def test_a_departed_replicas_series_leave_metrics():
    reps = [FakeReplica("r0"), FakeReplica("r1")]
    for r in reps:
        await r.start()
    app, stub, channel = await start_router(",".join(f"{r.replica_id}={r.address}" for r in reps))
    app.cluster.clock = lambda: 0.0  # no probe comes due: r0 stays quarantined
    try:
        reps[0].fail_next = 1  # r0 refuses once: a quarantine series for it too
        for _ in range(3):
            [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text="hello", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=10)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as client:

            async def series(rid: str) -> list[str]:
                text = (await client.get("/metrics")).text
                return sorted(line.split("{")[0] for line in text.splitlines() if f'replica="{rid}"' in line and not line.startswith("#"))

            assert await series("r0") == [
                "unicache_router_indexed_blocks",
                "unicache_router_quarantines_created",
                "unicache_router_quarantines_total",
                "unicache_router_replica_in_flight",
                "unicache_router_replica_load",
                "unicache_router_replica_quarantined",
                "unicache_router_routing_decisions_created",
                "unicache_router_routing_decisions_total",
            ]
            assert "unicache_router_cached_tokens_total" in await series("r1")
            app.cluster.remove("r0")
            assert await series("r0") == []
            assert "unicache_router_cached_tokens_total" in await series("r1")
    finally:
        await channel.close()
        await app.stop()
        for r in reps:
            await r.stop()


# --- a stall is silence at the replica -----------------------------------------------------------
class HeldCall:
    """A stand-in for a grpc.aio call whose first read answers after ``after_s``."""

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.cancelled = False

    async def read(self):
        await asyncio.sleep(self.after_s)
        return "first"

    def cancel(self):
        self.cancelled = True


async def test_a_replica_streaming_to_others_is_busy_not_stalled():
    # Silent replica: the first-token timeout (0.2 s) fires long before its answer (2 s).
    silent = GrpcReplicaStream(HeldCall(2.0))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await silent.first(0.2, lambda: 0.0)
    assert (info.value.code(), silent.timed_out, silent._call.cancelled) == (grpc.StatusCode.DEADLINE_EXCEEDED, True, True)
    # Same wait, but the replica keeps sending messages on other streams: it is waited for.
    busy = GrpcReplicaStream(HeldCall(2.0))
    assert await busy.first(0.2, time.monotonic) == "first"
    assert (busy.timed_out, busy._call.cancelled) == (False, False)
    # ... up to the ceiling.
    capped = GrpcReplicaStream(HeldCall(2.0))
    with pytest.raises(grpc.aio.AioRpcError):
        await capped.first(0.2, time.monotonic, max_wait_s=0.4)
    assert capped.timed_out


async def test_ten_ghost_replicas_cost_no_client_failure_and_one_attempt_each():
    ghosts = {f"g{i}": dead_address() for i in range(10)}
    live = [FakeReplica("r0"), FakeReplica("r1")]
    for r in live:
        await r.start()
    spec = ",".join([f"{g}={a}" for g, a in ghosts.items()] + [f"{r.replica_id}={r.address}" for r in live])
    app, stub, channel = await start_router(spec)
    app.cluster.clock = lambda: 0.0  # no probe comes due: a quarantined ghost stays out
    dialled: list[str] = []
    generate = app.clients.generate
    app.clients.generate = lambda address, request, *args: dialled.append(address) or generate(address, request, *args)
    try:
        replies = []
        for _ in range(30):
            msgs = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text="hello"), timeout=10)]
            replies.append(msgs[0].route.replica_id)
        assert sorted(set(replies)) == ["r0", "r1"] and len(replies) == 30  # every request served
        # Each ghost refused once and was quarantined at once: never dialled again.
        assert sorted(a for a in dialled if a in ghosts.values()) == sorted(ghosts.values())
        assert [app.cluster.healthy(g) for g in ghosts] == [False] * 10
        assert app.metrics.registry.get_sample_value("unicache_router_retries_total") == 10
        assert [len(r.served) for r in live] == [14, 16]  # round robin over the healthy set as it shrinks
    finally:
        await channel.close()
        await app.stop()
        for r in live:
            await r.stop()
