"""The live cost model: the fit recovers known costs and follows a change, the observer
feeds it from the request path, and cache_aware prices decisions in its seconds."""

from __future__ import annotations

import math
import random

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.cluster.index import LocalityIndex
from unicache.router.request_path.cost_observer import CostObserver
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
import numpy as np

from unicache.router.routing.cost_model import PRIOR, CostModel, Costs, FleetFit, Moments, huber_fit, speed_scale
from unicache.v1 import common_pb2, replica_pb2

BS = 16


def feed(model: CostModel, rid: str, n: int, a: float, b: float, s: float, rng: random.Random, outliers: int = 0) -> None:
    """``n`` TTFT observations of a + b * tokens + s * outstanding with 1 ms noise; every
    ``outliers``-th one 2 s late (a stall)."""
    for i in range(n):
        u, q, o = rng.randint(0, 2000), rng.randint(0, 300), rng.randint(0, 6)
        y = a + b * (u + q) + s * o + rng.gauss(0.0, 0.001)
        if outliers and i % outliers == 0:
            y += 2.0
        model.observe_ttft(rid, y, u, q, o)


def test_fit_recovers_known_costs_despite_stalls():
    model = CostModel()
    feed(model, "r1", 200, 0.010, 2e-4, 0.030, random.Random(1), outliers=17)
    c = model.costs("r1")
    assert c.fitted and c.observations == 128
    assert c.prefill_base_s == pytest.approx(0.010, abs=1e-3)
    assert c.prefill_per_token_s == pytest.approx(2e-4, rel=0.02)
    assert c.per_outstanding_s == pytest.approx(0.030, rel=0.05)


def test_fit_follows_a_change_within_its_window():
    model = CostModel(window=64)
    rng = random.Random(2)
    feed(model, "r1", 100, 0.010, 2e-4, 0.030, rng)
    feed(model, "r1", 64, 0.050, 1e-3, 0.010, rng)  # the backend got slower per token
    c = model.costs("r1")
    assert c.prefill_base_s == pytest.approx(0.050, abs=2e-3)
    assert c.prefill_per_token_s == pytest.approx(1e-3, rel=0.02)
    assert c.per_outstanding_s == pytest.approx(0.010, rel=0.2)


def test_prior_until_enough_observations_then_the_fleet_mean_for_the_others():
    model = CostModel(min_observations=16)
    assert model.uniform and model.costs("r1") == PRIOR
    feed(model, "r1", 15, 0.010, 2e-4, 0.030, random.Random(3))
    assert model.uniform and model.costs("r1") == PRIOR
    feed(model, "r1", 1, 0.010, 2e-4, 0.030, random.Random(4))
    assert not model.uniform and model.costs("r1").fitted
    other = model.costs("r2")  # no observation of its own: priced as the fleet's mean
    assert not other.fitted and other.prefill_per_token_s == model.costs("r1").prefill_per_token_s


def test_a_feature_that_does_not_vary_keeps_its_prior_and_slopes_never_go_negative():
    us = np.arange(16.0) * 100.0
    coef = huber_fit(np.column_stack([us, np.zeros(16)]), 0.005 + 3e-4 * us, (0.0, 1e-4, 0.02))  # outstanding always 0
    assert coef[0] == pytest.approx(0.005) and coef[1] == pytest.approx(3e-4) and coef[2] == 0.02
    coef = huber_fit(np.column_stack([us, np.arange(16.0) % 4]), 0.5 - 1e-4 * us, (0.0, 1e-4, 0.02))  # impossible
    assert coef[1] == 0.0 and all(c >= 0.0 for c in coef)


def test_identical_backends_are_priced_identically_despite_noise_and_stalls():
    """Two backends with the same costs, seen under different loads with 5% noise and a
    stall each now and then: one fleet shape, both speeds exactly 1, equal costs."""
    model = CostModel()
    rng = random.Random(11)
    for i in range(400):
        for rid, lo, hi in (("r0", 0, 2), ("r1", 2, 8)):  # r1 always busier
            u, o = rng.randint(0, 2000), rng.randint(lo, hi)
            y = (0.05 + 1e-4 * u + 0.06 * o) * rng.uniform(0.95, 1.05) + (1.5 if i % 37 == 0 else 0.0)
            model.observe_ttft(rid, y, u, 0, o)
    c0, c1 = model.costs("r0"), model.costs("r1")
    assert c0.fitted and c1.fitted and model.speed("r0") == model.speed("r1") == 1.0
    assert (c0.prefill_base_s, c0.prefill_per_token_s, c0.per_outstanding_s) == (
        c1.prefill_base_s, c1.prefill_per_token_s, c1.per_outstanding_s)
    assert c0.prefill_base_s == pytest.approx(0.05, rel=0.1) and c0.per_outstanding_s == pytest.approx(0.06, rel=0.1)


def test_a_backend_slower_beyond_noise_gets_its_speed_and_one_that_slows_is_followed():
    model = CostModel(window=64)
    rng = random.Random(12)

    def feed_both(n: int, slow_factor: float) -> None:
        for _ in range(n):
            for rid, f in (("fast", 1.0), ("slow", slow_factor)):
                u, o = rng.randint(0, 2000), rng.randint(0, 4)
                model.observe_ttft(rid, f * (0.02 + 2e-4 * u + 0.03 * o) * rng.uniform(0.9, 1.1), u, 0, o)

    feed_both(100, 1.0)
    assert model.speed("fast") == model.speed("slow") == 1.0
    feed_both(64, 2.0)  # "slow" got twice as slow: within one window its speed says so
    # each speed is short of the truth by 3 standard errors (the soft threshold) of its
    # latest 16 observations (min_observations): ~0.1 here
    ratio = model.speed("slow") / model.speed("fast")
    assert 1.6 < ratio < 2.0
    assert model.costs("slow").ttft_s(500, 0, 1) == pytest.approx(ratio * model.costs("fast").ttft_s(500, 0, 1))


def test_a_backend_without_a_speed_of_its_own_is_priced_as_the_typical_one_not_the_bare_shape():
    """CI's starved backend: "b" answered a few requests slowly (a cold engine), "a" many
    quickly. Priced at the bare shape "b" stood 2.5x above "a" and drew nothing more; it
    is priced as the median speed of the backends that have one ("a"'s) until its own."""
    model = CostModel()
    rng = random.Random(13)
    for _ in range(6):
        u = rng.randint(100, 200)
        model.observe_ttft("b", 3.0 * (0.01 + 1e-4 * u) * rng.uniform(0.95, 1.05), u, 0, 0)
    for _ in range(40):
        u, o = rng.randint(100, 200), rng.randint(0, 3)
        model.observe_ttft("a", (0.01 + 1e-4 * u + 0.005 * o) * rng.uniform(0.95, 1.05), u, 0, o)
    a, b = model.costs("a"), model.costs("b")
    assert a.fitted and not b.fitted and model.speed("a") < 1.0  # "a" is faster than the fleet's mean
    assert b.ttft_s(160, 0, 1) == pytest.approx(a.ttft_s(160, 0, 1))
    assert model.costs("new") == b  # never seen at all: the same
    for _ in range(16):  # once "b" has enough answers of its own, they price it
        u = rng.randint(100, 200)
        model.observe_ttft("b", 3.0 * (0.01 + 1e-4 * u) * rng.uniform(0.95, 1.05), u, 0, 0)
    assert model.costs("b").fitted and model.costs("b").ttft_s(160, 0, 0) > 2.0 * model.costs("a").ttft_s(160, 0, 0)


def test_speed_scale_is_one_inside_the_noise_and_the_part_beyond_it_outside():
    rng = np.random.default_rng(1)
    assert speed_scale(Moments.of(rng.normal(0.0, 0.5, 100)), Moments.of(rng.normal(0.0, 0.5, 100))) == 1.0
    own, rest = np.tile([0.6, 0.8], 50), np.tile([-0.1, 0.1], 50)  # means 0.7 and 0.0, sd 0.1005 each
    # own less the fleet's mean: 0.35; its standard error: 0.5 * sqrt(2 * 0.1005**2 / 100)
    se = 0.5 * np.sqrt(2 * np.var(own, ddof=1) / 100)
    mo, mr = Moments.of(own), Moments.of(rest)
    assert speed_scale(mo, mr) == pytest.approx(np.exp(0.35 - 3 * se))
    assert speed_scale(mr, mo) == pytest.approx(1 / speed_scale(mo, mr))
    assert speed_scale(mo, Moments.of(rest[:1])) == 1.0 and speed_scale(Moments.of(own[:2]), mr) == 1.0  # too few rows
    assert speed_scale(mo, Moments(0, 0.0, 0.0)) == 1.0  # alone in the fleet
    # the rest taken off the fleet's totals is the rest's own moments
    both = Moments.of(np.concatenate([own, rest])).minus(mo)
    assert (both.n, both.mean(), both.var()) == pytest.approx((mr.n, mr.mean(), mr.var()))


def test_the_fleet_refits_every_refit_every_observations_per_backend():
    fit = FleetFit((0.0, 1e-4), window=16, refit_every=4, min_observations=4)
    refits = [fit.add(f"r{i % 2}", (float(i),), 0.01 + 1e-3 * i) for i in range(20)]
    # the fleet's 4th observation fits it; then every 8 (4 per backend, 2 backends)
    assert [i for i, r in enumerate(refits) if r] == [3, 6, 7, 15]  # r0 and r1 reach 4 at 6 and 7
    assert fit.coef == pytest.approx([0.01, 1e-3]) and fit.scales == {"r0": 1.0, "r1": 1.0}


def test_calibration_round_trip_and_refusals(tmp_path):
    model = CostModel()
    feed(model, "r1", 32, 0.010, 2e-4, 0.030, random.Random(5))
    cal = model.to_calibration()
    assert sorted(cal["backends"]) == ["r1"]
    path = tmp_path / "cal.json"
    import json
    path.write_text(json.dumps(cal))
    loaded = CostModel.from_calibration(str(path))
    assert loaded.frozen and loaded.costs("r1") == Costs(**{**cal["backends"]["r1"]})
    loaded.observe_ttft("r1", 9.0, 10, 0, 0)  # frozen: ignored
    assert loaded.costs("r1") == Costs(**cal["backends"]["r1"])
    with pytest.raises(ValueError, match="version"):
        CostModel.from_calibration({"backends": {}})
    with pytest.raises(ValueError, match="prefill_per_token_s must be a non-negative number"):
        CostModel.from_calibration({"version": 1, "backends": {"r1": {"prefill_per_token_s": -1}}})
    with pytest.raises(ValueError, match="cannot read calibration"):
        CostModel.from_calibration(str(tmp_path / "missing.json"))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _request(rid: str, n_blocks: int) -> RoutingRequest:
    hs = hash_id_blocks(list(range(n_blocks)))
    return RoutingRequest(rid, RequestClass(tenant="t", task=Task.OTHER), hs, n_blocks * BS, BS)


def test_observer_feeds_ttft_with_usage_itl_and_the_prediction_error():
    model = CostModel(min_observations=1, refit_every=1)
    clock = Clock()
    errors = []
    obs = CostObserver(model, prefill_lanes=4, on_error=lambda *a: errors.append(a), clock=clock)
    req = _request("q1", 10)
    load = ReplicaLoad("r1", running=2, waiting=1, queued_prefill_tokens=400, in_flight=2)
    obs.dispatched(req, RouteDecision("r1", "index_prefix", matched_blocks=4), load)
    predicted = PRIOR.ttft_s(160 - 64, 100.0, 3)
    clock.t += 0.25
    obs.first_token("q1")
    assert errors == [("r1", predicted, pytest.approx(0.25))]
    obs.message("q1", replica_pb2.GenerateResponse(token_ids=[1]))  # the first message: part of the TTFT
    for _ in range(4):
        clock.t += 0.05
        obs.message("q1", replica_pb2.GenerateResponse(token_ids=[2]))
    last = replica_pb2.GenerateResponse(usage=common_pb2.Usage(prompt_tokens=160, cached_tokens=48))
    obs.message("q1", last)
    obs.finished("q1")
    ttft, itl = model._ttft.rings["r1"], model._itl.rings["r1"]
    assert ttft._xs == [(112.0 + 100.0, 3.0)] and ttft._ys == [pytest.approx(0.25)]
    assert itl._xs == [(3.0,)] and itl._ys == [pytest.approx(0.05)]
    assert len(obs) == 0
    # a request that never had its first token feeds nothing
    obs.dispatched(_request("q2", 2), RouteDecision("r1", "load"), load)
    obs.finished("q2")
    assert len(ttft._ys) == 1 and len(obs) == 0


def _index(holdings: dict[str, int]) -> LocalityIndex:
    idx = LocalityIndex()
    for rid, n in holdings.items():
        idx.apply_events_unchecked(rid, hash_id_blocks(list(range(n))), [])
    return idx


def _fitted(a: float, b: float, s: float) -> CostModel:
    return CostModel.from_calibration({"version": 1, "backends": {
        "r0": {"prefill_base_s": a, "prefill_per_token_s": b, "per_outstanding_s": s},
        "r1": {"prefill_base_s": a, "prefill_per_token_s": b, "per_outstanding_s": s}}})


def _busy_holder_vs_idle():
    """r0 holds 19 of the prompt's 20 blocks and decodes one request; r1 holds nothing and is idle."""
    loads = [ReplicaLoad("r0", running=1, free_blocks=1000, capacity_blocks=1000, in_flight=1),
             ReplicaLoad("r1", free_blocks=1000, capacity_blocks=1000)]
    return _request("q", 20), loads, _index({"r0": 19})


def test_priced_in_tokens_the_holder_wins():
    req, loads, idx = _busy_holder_vs_idle()
    d = CacheAwarePolicy().choose(req, loads, idx)
    # (320 - 19 * 16) + 128 * 1 = 144 against 320
    assert (d.replica_id, d.reason, d.score) == ("r0", "index_prefix", 144.0)
    d = CacheAwarePolicy(cost_model=CostModel()).choose(req, loads, idx)  # a model with nothing fitted: the same
    assert (d.replica_id, d.reason, d.score) == ("r0", "index_prefix", 144.0)


def test_where_a_hit_saves_little_the_policy_balances_and_where_it_saves_much_it_follows_the_cache():
    req, loads, idx = _busy_holder_vs_idle()
    # decode-heavy: a token costs 30 us, a request ahead 30 ms: r0 0.01 + 16 * 3e-5 + 0.03
    # against r1 0.01 + 320 * 3e-5
    d = CacheAwarePolicy(cost_model=_fitted(0.01, 3e-5, 0.03)).choose(req, loads, idx)
    assert (d.replica_id, d.reason) == ("r1", "load") and d.score == pytest.approx(0.01 + 320 * 3e-5)
    # prefill-heavy: a token costs 1 ms: r0 0.01 + 0.016 + 0.03 against r1 0.01 + 0.32
    d = CacheAwarePolicy(cost_model=_fitted(0.01, 1e-3, 0.03)).choose(req, loads, idx)
    assert (d.replica_id, d.reason) == ("r0", "index_prefix") and d.score == pytest.approx(0.056)


def test_a_slower_backend_draws_less():
    """Two idle backends, nothing cached: the one whose tokens cost twice as much loses."""
    model = CostModel.from_calibration({"version": 1, "backends": {
        "r0": {"prefill_base_s": 0.01, "prefill_per_token_s": 2e-4, "per_outstanding_s": 0.03},
        "r1": {"prefill_base_s": 0.01, "prefill_per_token_s": 1e-4, "per_outstanding_s": 0.03}}})
    loads = [ReplicaLoad("r0", free_blocks=1000, capacity_blocks=1000), ReplicaLoad("r1", free_blocks=1000, capacity_blocks=1000)]
    d = CacheAwarePolicy(cost_model=model).choose(_request("q", 20), loads, LocalityIndex())
    assert (d.replica_id, d.reason) == ("r1", "load")


def test_a_calibration_is_assigned_to_another_fleets_replicas_in_order():
    model = CostModel.from_calibration({"version": 1, "backends": {
        "vllm-b": {"prefill_per_token_s": 2e-4}, "vllm-a": {"prefill_per_token_s": 1e-4}}})
    sim = model.assigned(["r0", "r1", "r2"])
    assert [sim.costs(r).prefill_per_token_s for r in ("r0", "r1", "r2")] == [1e-4, 2e-4, 1e-4]
    assert sim.frozen and model.mean_costs().prefill_per_token_s == pytest.approx(1.5e-4)


def test_features_that_vary_only_together_still_give_a_fit():
    """Every prompt 160 tokens and 40 queued tokens per request ahead: tokens = 160 + 40 *
    outstanding, so the two cannot be told apart; the last keeps its prior, the rest is fitted."""
    outstanding = np.array([0.0, 1, 0, 2, 0, 1, 3, 0])
    xs = np.column_stack([160 + 40 * outstanding, outstanding])
    coef = huber_fit(xs, 0.01 + 1e-4 * xs[:, 0] + 0.02 * outstanding, (0.0, 1e-4, 0.02))
    assert coef == pytest.approx([0.01, 1e-4, 0.02])
    model = CostModel(min_observations=8)
    for o, x in zip(outstanding, xs):
        model.observe_ttft("r1", 0.01 + 1e-4 * x[0] + 0.02 * o, x[0], 0, o)
    assert model.costs("r1").fitted


def test_the_speed_is_judged_on_each_backends_latest_eighth_of_a_window():
    from unicache.router.routing.cost_model import _Ring

    ring = _Ring(8)
    for i in range(11):
        ring.add((float(i),), float(i))
    assert ring.recent(3) == ([(8.0,), (9.0,), (10.0,)], [8.0, 9.0, 10.0])  # in time order across the wrap
    assert ring.recent(20)[1] == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    model = CostModel()  # window 128: speeds on the last 16
    rng = random.Random(13)
    for i in range(160):
        for rid in ("a", "b"):
            f = 3.0 if rid == "b" and i >= 144 else 1.0  # b slows for its last 16 answers
            u, o = rng.randint(0, 2000), rng.randint(0, 4)
            model.observe_ttft(rid, f * (0.02 + 2e-4 * u + 0.03 * o) * rng.uniform(0.9, 1.1), u, 0, o)
    assert model.speed("b") / model.speed("a") > 2.5


def _two_alike(rng: random.Random) -> CostModel:
    """A model fitted on two identical backends "a" and "b" with 10% noise."""
    model = CostModel(window=64)
    for _ in range(64):
        for rid in ("a", "b"):
            u, o = rng.randint(0, 2000), rng.randint(0, 4)
            model.observe_ttft(rid, (0.02 + 2e-4 * u + 0.03 * o) * rng.uniform(0.9, 1.1), u, 0, o)
    return model


def test_a_request_waiting_beyond_its_predictions_noise_prices_its_backend_up_until_it_is_answered():
    """A stalled backend answers nothing, so no observation prices it: the request it holds
    does, by the part of its wait beyond the fleet's noise, and only while it waits."""
    model = _two_alike(random.Random(14))
    assert model.costs("a") == model.costs("b") and model.overdue("b") == 1.0
    threshold = model.overdue_threshold()
    assert threshold is not None and 0.0 < threshold < math.log(1.5)  # 10% noise: one request's 3 sd
    clock = Clock()
    counted: list[tuple[str, float]] = []
    obs = CostObserver(model, clock=clock, on_overdue=lambda rid, s: counted.append((rid, s)))
    idle = ReplicaLoad("b")
    obs.dispatched(_request("stuck", 10), RouteDecision("b", "load"), idle)
    predicted = model.costs("b").ttft_s(10 * BS, 0.0, 0)
    clock.t += 1.1 * predicted  # late, but inside the noise
    obs.dispatched(_request("n1", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    obs.first_token("n1")  # "a" answers at once
    assert model.overdue("b") == 1.0
    clock.t += 20 * predicted - 1.1 * predicted  # 20x its prediction: beyond it
    obs.dispatched(_request("n2", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    obs.first_token("n2")  # "a" answers at once
    factor = math.exp(math.log(20.0) - threshold)
    assert model.overdue("b") == pytest.approx(factor) and model.overdue("a") == 1.0
    a, b = model.costs("a"), model.costs("b")
    assert b.ttft_s(160, 0, 1) == pytest.approx(factor * a.ttft_s(160, 0, 1))
    assert (b.decode_base_s, b.decode_per_seq_s) == (a.decode_base_s, a.decode_per_seq_s)
    assert model.snapshot()["b"]["overdue_factor"] == pytest.approx(factor)
    # never in what is fitted or written down
    assert model.to_calibration()["backends"]["a"] == model.to_calibration()["backends"]["b"]
    obs.first_token("stuck")
    obs.dispatched(_request("n3", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    obs.first_token("n3")  # "a" answers at once
    assert model.overdue("b") > 1.0  # looked at most every overdue_every_s: not yet
    clock.t += 1.5 * obs.overdue_every_s
    obs.dispatched(_request("n4", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    obs.first_token("n4")  # "a" answers at once
    assert model.overdue("b") == 1.0 and model.costs("a") == model.costs("b")
    # the time between the look that priced b overdue and the one that took it off counts
    assert counted == [("b", pytest.approx(1.5 * obs.overdue_every_s))]
    clock.t += 10.0
    obs.dispatched(_request("n5", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    assert len(counted) == 1  # nothing priced overdue since: nothing more counted


def test_no_wait_is_overdue_under_the_prior_an_unstreamed_answer_is_not_watched_and_a_frozen_model_is_never_raised():
    clock = Clock()
    prior = CostModel()
    obs = CostObserver(prior, clock=clock)
    obs.dispatched(_request("q", 10), RouteDecision("b", "load"), ReplicaLoad("b"))
    clock.t += 100.0
    obs.dispatched(_request("q2", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    assert prior.overdue_threshold() is None and prior.overdue("b") == 1.0 and prior.uniform

    model = _two_alike(random.Random(15))
    obs = CostObserver(model, clock=clock)
    errors_before = model.error("b")
    obs.dispatched(_request("whole", 10), RouteDecision("b", "load"), ReplicaLoad("b", running=2), streamed=False)
    clock.t += 100.0
    obs.dispatched(_request("q3", 10), RouteDecision("a", "load"), ReplicaLoad("a"))
    obs.first_token("q3")
    assert model.overdue("b") == 1.0  # an unstreamed answer's wait is not watched
    obs.first_token("whole")  # the whole answer
    assert model.error("b") == errors_before  # its wait is not a TTFT to score
    obs.usage("whole", prompt_tokens=160, cached_tokens=32, completion_tokens=11)
    itl = model.costs("b").itl_s(3)
    obs.finished("whole")
    xs, ys = model._ttft.rings["b"].recent(1)
    assert xs == [(128.0, 2.0)] and ys == [pytest.approx(100.0 - 10 * itl)]

    frozen = CostModel.from_calibration(model.to_calibration())
    frozen.set_overdue({"b": 5.0})
    assert frozen.overdue("b") == 1.0 and frozen.overdue_threshold() is None
