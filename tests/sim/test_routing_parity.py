"""Parity: the live router's policy path (index from Redis, loads from heartbeats) makes
the simulator's decisions on the same trace slice when its index is fresh
(``unicache.testing.routing_parity``: the simulated replicas publish through the real
``CachePublisher``, the router follows Redis with its real subscriber)."""

from __future__ import annotations

from unicache.sim.replay import ReplayConfig
from unicache.sim.suite import SuiteTrace, load_suite_trace
from unicache.sim.timing import TimingModel
from unicache.testing.routing_parity import run_parity

PREFIX = "parity"


async def test_live_policy_path_makes_the_simulators_decisions(redis_server):
    # A balanced-family slice: sessions, agents, templates and plain requests, 2 tenants.
    trace = load_suite_trace(SuiteTrace("balanced", "report", 0, 7), duration=40.0, requests_per_s=2.0)
    largest = max(-(-r.num_tokens // trace.block_size) for r in trace.requests)
    cfg = ReplayConfig("unicache", 2 * largest, replicas=2, router="cache_aware", rate_scale=4.0,
                       timing=TimingModel(decode_s_per_token=0.01))
    rec = await run_parity(redis_server.url, PREFIX, trace, cfg)
    n = len(trace.requests)
    assert [s.request_id for s in rec.steps] == [str(i) for i in range(n)]
    assert [(s.live, s.live_reason) for s in rec.steps] == [(s.sim, s.sim_reason) for s in rec.steps]
    assert rec.agreement == 1.0
    # The slice exercises what parity is about: decisions by the index and by sessions,
    # both replicas used, and evictions (removed blocks must reach the router too).
    reasons = {s.sim_reason for s in rec.steps}
    assert {"index_prefix", "session_home"} <= reasons, reasons
    assert {s.sim for s in rec.steps} == {"r0", "r1"}
    assert rec.result["evictions"] > 0


async def test_with_a_fitted_cost_model_the_live_policy_makes_the_simulators_decisions(redis_server):
    """Both sides price decisions with one calibration (r0's tokens cost three times r1's,
    a request ahead costs 40 ms): the decisions are in seconds, and still equal."""
    from unicache.router.routing.cost_model import CostModel

    model = CostModel.from_calibration({"version": 1, "backends": {
        "gpu-a": {"prefill_base_s": 0.01, "prefill_per_token_s": 3e-4, "per_outstanding_s": 0.04},
        "gpu-b": {"prefill_base_s": 0.01, "prefill_per_token_s": 1e-4, "per_outstanding_s": 0.04}}})
    trace = load_suite_trace(SuiteTrace("balanced", "report", 0, 7), duration=40.0, requests_per_s=2.0)
    largest = max(-(-r.num_tokens // trace.block_size) for r in trace.requests)
    cfg = ReplayConfig("unicache", 2 * largest, replicas=2, router="cache_aware", rate_scale=4.0,
                       timing=TimingModel.from_costs(model.mean_costs()), cost_model=model)
    rec = await run_parity(redis_server.url, PREFIX + "-costs", trace, cfg)
    assert [(s.live, s.live_reason) for s in rec.steps] == [(s.sim, s.sim_reason) for s in rec.steps]
    assert rec.agreement == 1.0
    # priced in seconds, the faster backend (r1, gpu-b's costs) computes most of the
    # prompts: the long ones go there (token units split them 20,328 / 19,877 tokens)
    by_id = {str(i): r for i, r in enumerate(trace.requests)}
    prompt_tokens = {r: sum(by_id[s.request_id].num_tokens for s in rec.steps if s.sim == r) for r in ("r0", "r1")}
    assert prompt_tokens["r1"] > 1.5 * prompt_tokens["r0"], prompt_tokens
