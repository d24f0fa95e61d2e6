"""Overload admission (router/request_path/overload.py): which request the queue bounds
refuse, with which bound and Retry-After, and the 429 / RESOURCE_EXHAUSTED a client gets
through a live router before any replica sees the request."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.request_path.cost_observer import CostObserver
from unicache.router.request_path.drain_rate import DrainRates
from unicache.router.request_path.overload import Overloaded, OverloadConfig, OverloadGuard, queued_requests
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cost_model import CostModel
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc


def guard(**cfg) -> OverloadGuard:
    cfg.setdefault("retry_after_s", 3)
    return OverloadGuard(OverloadConfig(**cfg), block_size=16, predict=CostObserver(CostModel()).predicted_ttft_s)


def refusal(g: OverloadGuard, loads: list[ReplicaLoad], prompt: int) -> tuple[str, int] | None:
    try:
        g.check(loads, prompt)
    except Overloaded as exc:
        assert exc.kind == "overloaded"
        return exc.bound, exc.retry_after_s
    return None


def test_queued_requests_leave_out_what_the_backend_runs():
    assert queued_requests(ReplicaLoad("a", in_flight=3)) == 3  # nothing reported running: all queued
    assert queued_requests(ReplicaLoad("a", running=4, waiting=1, in_flight=5)) == 1
    assert queued_requests(ReplicaLoad("a", running=4, waiting=6, in_flight=2)) == 6  # other routers' requests wait too
    assert queued_requests(ReplicaLoad("a", running=8, in_flight=2)) == 0


def test_refused_only_when_every_backend_is_full():
    g = guard(backend_queue=2, backend_queue_tokens=0)
    assert refusal(g, [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=1)], 10) is None
    assert refusal(g, [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=2)], 10) == ("backends_full", 3)
    assert refusal(g, [ReplicaLoad("a", running=4, waiting=1, in_flight=5)], 10) is None  # 1 queued, 4 running
    assert refusal(g, [], 10) is None  # no backend: the request path answers "unavailable"


def test_token_bound_is_a_multiple_of_the_reported_kv_capacity():
    g = guard(backend_queue=0, backend_queue_tokens=1.0)  # 10 blocks x 16 tokens: 160 tokens
    a = ReplicaLoad("a", queued_prefill_tokens=100, capacity_blocks=10)
    assert g.token_bound(a) == 160
    assert refusal(g, [a], 60) is None
    assert refusal(g, [a], 61) == ("backends_full", 3)
    assert refusal(g, [ReplicaLoad("a", capacity_blocks=10)], 10_000) is None  # an empty queue takes any prompt
    assert refusal(g, [a, ReplicaLoad("b", queued_prefill_tokens=500)], 61) is None  # b reports no capacity: no bound
    half = guard(backend_queue=0, backend_queue_tokens=0.5)
    assert half.token_bound(a) == 80 and refusal(half, [a], 1) == ("backends_full", 3)


def test_fleet_bounds_refuse_before_every_backend_is_full():
    g = guard(backend_queue=10, backend_queue_tokens=0, fleet_queue=3)
    assert refusal(g, [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=0)], 10) is None
    assert refusal(g, [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=1)], 10) == ("fleet_requests", 3)
    t = guard(backend_queue=0, backend_queue_tokens=1.0, fleet_queue_tokens=300)
    loads = [ReplicaLoad("a", queued_prefill_tokens=150, capacity_blocks=100), ReplicaLoad("b", queued_prefill_tokens=100, capacity_blocks=100)]
    assert refusal(t, loads, 50) is None  # 300 of 300
    assert refusal(t, loads, 51) == ("fleet_tokens", 3)
    derived = guard(backend_queue=2, backend_queue_tokens=0)  # fleet bound: 2 + 2
    assert refusal(derived, [ReplicaLoad("a", waiting=3), ReplicaLoad("b", waiting=1)], 1) == ("fleet_requests", 3)


def test_no_bound_at_all_when_switched_off():
    g = guard(backend_queue=0, backend_queue_tokens=0)
    assert refusal(g, [ReplicaLoad("a", waiting=10**6, queued_prefill_tokens=10**9, capacity_blocks=1)], 10**6) is None


def test_retry_after_is_the_predicted_wait_at_the_least_loaded_backend():
    # the request path's prediction: the prior's 2**-13 s per prompt token and per queued
    # token per prefill lane (4), 128 tokens' worth per request outstanding there
    g = OverloadGuard(OverloadConfig(backend_queue=1, backend_queue_tokens=0), block_size=16,
                      predict=CostObserver(CostModel()).predicted_ttft_s)
    a = ReplicaLoad("a", in_flight=1, queued_prefill_tokens=3 * 8192)  # (8192 + 24576 / 4) / 8192 + 1/64 = 1.77 s
    b = ReplicaLoad("b", in_flight=2)  # 8192 / 8192 + 2/64 = 1.03 s
    assert g.retry_after_s([a, b], 8192) == 2
    assert refusal(g, [a, b], 8192) == ("backends_full", 2)
    assert g.retry_after_s([ReplicaLoad("c", in_flight=1)], 1) == 1  # at least 1 s
    assert g.retry_after_s([ReplicaLoad("c", in_flight=1, queued_prefill_tokens=10**7)], 1) == 60  # at most 60 s


def test_rejections_are_counted_by_bound():
    g = guard(backend_queue=1, backend_queue_tokens=0, fleet_queue=1)
    for loads in ([ReplicaLoad("a", in_flight=1)], [ReplicaLoad("a", in_flight=1)], [ReplicaLoad("a"), ReplicaLoad("b", in_flight=1)]):
        refusal(g, loads, 1)
    assert {b: g.rejections.labels(b)._value.get() for b in ("backends_full", "fleet_requests", "fleet_tokens")} == {
        "backends_full": 2, "fleet_requests": 1, "fleet_tokens": 0}


def test_wait_bound_refuses_only_when_every_known_prediction_passes_the_budget():
    g = guard(retry_after_s=0)
    with pytest.raises(Overloaded) as err:
        g.check_wait(iter([("a", 12.0), ("b", 14.2)]), 5.0)
    assert (err.value.bound, err.value.retry_after_s) == ("wait", 7)  # best 12 s - budget 5 s
    assert str(err.value) == ("overloaded: every backend's predicted time to first token is past this request's wait "
                              "budget (best 12.0 s, budget 5.0 s); retry after 7 s")
    g.check_wait(iter([("a", 12.0), ("b", 4.9)]), 5.0)  # b has room
    g.check_wait(iter([("a", 12.0), ("b", None)]), 5.0)  # nothing known of b: it has room
    g.check_wait(iter([]), 5.0)  # no backend: the request path answers "unavailable"
    assert g.rejections.labels("wait")._value.get() == 1


def test_a_backend_measured_in_nothing_has_room_up_to_the_cold_bound():
    g = guard(retry_after_s=0, cold_queue=4)
    assert g.predicted_wait_s("a", ReplicaLoad("a", waiting=3), (9.0, False)) is None  # 3 queued: room
    cold = ReplicaLoad("a", waiting=4)
    assert g.predicted_wait_s("a", cold, (9.0, False)) == float("inf")
    assert g.predicted_wait_s("a", cold, (9.0, True)) == 9.0  # fitted: the wait bound decides
    with pytest.raises(Overloaded) as err:
        g.check_wait(iter([("a", float("inf")), ("b", float("inf"))]), 20.0)
    assert (err.value.bound, err.value.retry_after_s) == ("cold", 1)
    assert str(err.value) == ("overloaded: every backend has 4 requests queued and its wait is not measured yet; "
                              "retry after 1 s")
    g.check_wait(iter([("a", float("inf")), ("b", None)]), 20.0)  # b has room
    assert guard(cold_queue=0).predicted_wait_s("a", ReplicaLoad("a", waiting=10**6), (9.0, False)) is None  # off
    for _ in range(4):
        g.drains.dispatched("a")  # this router's own requests without a first token count too
    assert g.predicted_wait_s("a", ReplicaLoad("a"), (9.0, False)) == float("inf")
    assert g.rejections.labels("cold")._value.get() == 1


def test_wait_bound_reads_the_predictions_lazily():
    seen = []

    def predictions():
        for rid, wait in (("a", 1.0), ("b", 99.0)):
            seen.append(rid)
            yield rid, wait

    guard().check_wait(predictions(), 5.0)
    assert seen == ["a"]  # the chosen backend had room: no other was priced


def test_predicted_wait_is_the_larger_of_the_fit_and_the_queue_at_its_drain_rate():
    g = guard()
    now = [0.0]
    g.drains = DrainRates(window=4, min_intervals=2, clock=lambda: now[0])
    load = ReplicaLoad("a", running=4, waiting=6, in_flight=10)  # reports 6 waiting
    assert g.predicted_wait_s("a", load, (2.0, False)) is None  # a guess and no rate: nothing known
    assert g.predicted_wait_s("a", load, (2.0, True)) == 2.0  # the fit alone
    for _ in range(4):
        g.drains.dispatched("a")
    for t in (0.0, 1.0, 2.0):  # three starts, each leaving requests waiting: two service intervals
        now[0] = t
        g.drains.started("a")
    assert (g.drains.rate("a"), g.drains.unstarted("a")) == (1.0, 1)
    assert g.predicted_wait_s("a", load, (2.0, True)) == 6.0  # 6 waiting (more than our 1) at 1 per second
    assert g.predicted_wait_s("a", load, (9.0, True)) == 9.0
    assert g.predicted_wait_s("a", load, (9.0, False)) == 6.0  # the prior's guess is not used
    assert g.predicted_wait_s("a", ReplicaLoad("a"), (0.5, False)) == 1.0  # our one unstarted request
    now[0] = 2.5
    g.drains.started("a")  # the last one: the queue is empty after it
    now[0] = 100.0
    g.drains.dispatched("a")
    g.drains.dispatched("a")
    g.drains.started("a")  # after an idle gap: 97.5 s is no service interval
    now[0] = 100.5
    g.drains.started("a")
    assert g.drains.intervals_s("a") == [1.0, 1.0, 0.5, 0.5]
    g.drains.forget("a")
    assert g.drains.rate("a") is None and g.drains.unstarted("a") == 0


def test_unstarted_counts_are_matched_by_starts_and_abandons():
    d = DrainRates(window=8, min_intervals=1, clock=lambda: 5.0)
    d.dispatched("a")
    d.dispatched("a")
    d.abandoned("a")  # failed before its first token
    assert d.unstarted("a") == 1
    d.started("a")
    d.abandoned("a")  # never below zero
    d.abandoned("b")  # a backend never seen
    assert (d.unstarted("a"), d.unstarted("b"), d.rate("a")) == (0, 0, None)
    d.dispatched("a")
    d.dispatched("a")
    d.started("a")
    d.started("a")  # at the same instant: a zero interval gives no rate
    assert d.rate("a") is None and d.wait_s("a", 10) == 0.0
    with pytest.raises(ValueError):
        DrainRates(window=4, min_intervals=5)


def test_wait_budget_is_the_earliest_of_setting_deadline_and_client_timeout():
    assert guard(max_wait_s=20.0).wait_budget_s(300.0) == 20.0
    assert guard(max_wait_s=20.0).wait_budget_s(12.0) == 12.0  # what is left of the deadline
    assert guard(max_wait_s=20.0).wait_budget_s(300.0, 8.0) == 8.0  # the client's declared timeout
    assert guard(max_wait_s=0).wait_budget_s(300.0) == 300.0  # switched off: the deadline alone


def test_client_wait_budget_from_the_sdk_timeout_headers():
    from unicache.router.frontends.openai_request import client_wait_budget_s

    def headers(**h):
        return {k.replace("_", "-"): v for k, v in h.items()}.get

    assert client_wait_budget_s(headers()) is None
    assert client_wait_budget_s(headers(x_stainless_read_timeout="600")) == 600.0
    assert client_wait_budget_s(headers(x_stainless_read_timeout="60", x_stainless_timeout="20.5")) == 20.5
    # sent by SDKs on their own: a malformed value is ignored, never an error
    for bad in ("NOT_GIVEN", "-1", "0", "nan", "inf", ""):
        assert client_wait_budget_s(headers(x_stainless_timeout=bad)) is None


@pytest.mark.parametrize(("name", "value", "msg"), [
    ("backend_queue", -1, "overload_backend_queue must be a non-negative integer, got -1"),
    ("retry_after_s", 1.5, "overload_retry_after_s must be a non-negative integer, got 1.5"),
    ("backend_queue_tokens", -0.5, "overload_backend_queue_tokens must be a non-negative number, got -0.5"),
    ("max_wait_s", -1.0, "overload_max_wait_s must be a non-negative number of seconds, got -1.0"),
    ("cold_queue", -2, "overload_cold_queue must be a non-negative integer, got -2"),
    ("max_wait_s", float("nan"), "overload_max_wait_s must be a non-negative number of seconds, got nan"),
])
def test_bad_settings_are_refused_by_name(name, value, msg):
    with pytest.raises(UsageError, match=msg):
        OverloadConfig(**{name: value})


def test_settings_defaults_and_environment():
    cfg = build_config(env={})
    assert (cfg.overload_backend_queue, cfg.overload_backend_queue_tokens, cfg.overload_fleet_queue,
            cfg.overload_fleet_queue_tokens, cfg.overload_retry_after_s, cfg.overload_max_wait_s,
            cfg.overload_cold_queue) == (1024, 4.0, 0, 0, 0, 20.0, 0)
    cfg = build_config(env={"UNICACHE_OVERLOAD_BACKEND_QUEUE": "8", "UNICACHE_OVERLOAD_RETRY_AFTER_S": "5",
                            "UNICACHE_OVERLOAD_MAX_WAIT_S": "2.5"})
    assert (cfg.overload_backend_queue, cfg.overload_retry_after_s, cfg.overload_max_wait_s) == (8, 5, 2.5)


# ---------------------------------------------------------------- through the live router
@pytest.fixture
async def full_fleet():
    """Two static fake replicas that hold their streams; each may have one request queued."""
    reps = [FakeReplica("r0"), FakeReplica("r1")]
    for rep in reps:
        await rep.start()
        rep.hold = asyncio.Event()
    cfg = build_config(env={"UNICACHE_USE_REDIS": "false", "UNICACHE_SALT_SECRET": "s", "UNICACHE_AUTH_ENABLED": "false"}, overrides={
        "grpc_port": 0, "http_port": 0, "replicas": ",".join(f"{r.replica_id}={r.address}" for r in reps),
        "routing_policy": "round_robin", "overload_backend_queue": 1, "overload_retry_after_s": 3})
    app = RouterApp(cfg)
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        yield app, reps, router_pb2_grpc.RouterStub(channel), client
    finally:
        for rep in reps:
            rep.hold.set()
        await client.aclose()
        await channel.close()
        await app.stop()
        for rep in reps:
            await rep.stop()


def gen(stub, text: str = "hello there"):
    req = router_pb2.RouterGenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=3))
    return stub.Generate(req, timeout=30)


async def test_a_full_fleet_answers_429_and_resource_exhausted_with_retry_after(full_fleet):
    app, reps, stub, client = full_fleet
    held = [gen(stub), gen(stub)]
    where = [(await call.read()).route.replica_id for call in held]  # one request streaming at each replica, held open
    assert sorted(where) == ["r0", "r1"] and app.cluster.own_in_flight() == {"r0": 1, "r1": 1}

    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in gen(stub)]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == ("overloaded: every backend's queue is full (2 backends; bounds: 1 requests, "
                                   "4 x its KV capacity in tokens); retry after 3 s")
    trailers = dict(err.value.trailing_metadata())
    assert (trailers["retry-after"], trailers["grpc-retry-pushback-ms"]) == ("3", "3000")

    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        r = await client.post(path, json=body)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert r.json() == {"error": {"message": err.value.details(), "type": "rate_limit_error", "param": None,
                                      "code": "rate_limit_exceeded"}}
    assert [len(rep.requests) for rep in reps] == [1, 1]  # the refused requests reached no replica
    metrics = (await client.get("/metrics")).text
    assert 'unicache_router_overload_rejections_total{bound="backends_full"} 3.0' in metrics

    reps[0].hold.set()  # r0's request finishes: its queue has room again
    while await held[where.index("r0")].read() is not grpc.aio.EOF:
        pass
    await eventually(lambda: app.cluster.own_in_flight().get("r0", 0) == 0, "r0's request to finish")
    reps[1].hold.set()  # NOTE: admission does not steer: round robin may still send it to r1
    msgs = [m async for m in gen(stub)]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # admitted: r0 had room
    assert app.core.overload.rejections.labels("backends_full")._value.get() == 3


async def test_a_request_the_fitted_costs_say_cannot_start_in_time_gets_429_at_once(full_fleet):
    app, reps, stub, client = full_fleet
    for rep in reps:
        rep.hold.set()
    # Fitted costs: 2 s per request outstanding at dispatch, nothing else.
    model = CostModel.from_calibration({"version": 1, "backends": {
        rid: {"prefill_base_s": 0.0, "prefill_per_token_s": 0.0, "per_outstanding_s": 2.0} for rid in ("r0", "r1")}})
    app.core.costs.model = model
    app.core.overload.config = OverloadConfig(backend_queue=0, backend_queue_tokens=0)  # the wait bound alone
    body = {"prompt": "hi", "max_tokens": 2}
    r = await client.post("/v1/completions", json=body, headers={"x-stainless-read-timeout": "5"})
    assert r.status_code == 200  # idle: predicted 0 s
    for rep in reps:
        rep.hold.clear()
    held = [gen(stub), gen(stub), gen(stub), gen(stub)]  # 2 outstanding at each: 4 s predicted there
    for call in held:
        await call.read()
    r = await client.post("/v1/completions", json=body, headers={"x-stainless-read-timeout": "3"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"  # best 4 s, budget 3 s
    assert r.json()["error"]["message"] == ("overloaded: every backend's predicted time to first token is past this "
                                            "request's wait budget (best 4.0 s, budget 3.0 s); retry after 1 s")
    assert sum(len(rep.requests) for rep in reps) == 5  # the refused request reached no replica
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a gRPC client's own deadline is its budget
        [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=3.5)]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert app.core.overload.rejections.labels("wait")._value.get() == 2
    for rep in reps:
        rep.hold.set()
    for call in held:
        while await call.read() is not grpc.aio.EOF:
            pass
