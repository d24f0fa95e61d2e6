"""The balance rule of ``bench.studies.routing_balance`` (a study's variant, not a
production policy): exact decisions on hand-built states, and the session-atomic bound's
water filling."""

from __future__ import annotations

import pytest

from bench.studies.routing_balance import BalancePolicy, _pour
from tests.test_routing_policies import load, make_index, make_request
from unicache.router.routing.base import RouteDecision
from unicache.router.routing.cache_aware import CacheAwarePolicy

NO_DECAY = {"churn_window": 10**12, "churn_weight": 0.0, "footprint_weight": 0.0}


def _heavy_r0(policy):
    """r0 computed 800 tokens (a 640-token prompt, then a session's 160-token first
    turn), r1 nothing."""
    policy.on_request_routed(make_request("a", range(100, 140)), RouteDecision("r0", "load"))
    policy.on_request_routed(make_request("t0", range(10), session="s"), RouteDecision("r0", "load"))
    assert policy._inflow.as_dict() == {"r0": pytest.approx(800.0)}
    return policy


def test_hard_rule_moves_a_session_off_a_home_that_ran_ahead_free_rule_keeps_it():
    reps = [load("r0"), load("r1")]
    idx = make_index({"r0": list(range(10))})
    t1 = make_request("t1", range(12), session="s")  # 192 tokens, 10 blocks cached on r0
    # After t1: r0 832 (800 + 32), r1 192; cap max(1.2 x (800 + 32) / 2, 192) = 499.2.
    # TTFT admission alone keeps only r0 (32 against r1's 192 > 2 x 32); no replica is
    # in both sets, so the balance rule's own set decides: r1.
    d = _heavy_r0(BalancePolicy(beta=1.2, **NO_DECAY)).choose(t1, reps, idx)
    assert (d.replica_id, d.reason) == ("r1", "load")
    # The free rule never moves a session: home is judged by TTFT admission alone.
    d = _heavy_r0(BalancePolicy(beta=1.2, sessions_move=False, **NO_DECAY)).choose(t1, reps, idx)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "session_home", 10)
    # beta 2.1 admits r0 (832 <= 873.6): home.
    assert _heavy_r0(BalancePolicy(beta=2.1, **NO_DECAY)).choose(t1, reps, idx).reason == "session_home"


def test_balance_rule_sends_new_work_to_the_replica_behind():
    reps = [load("r0"), load("r1")]
    y = make_request("y", range(200, 210))  # 160 tokens, cached nowhere
    # Without the rule the costs tie (160 each) and the id decides: r0.
    assert _heavy_r0(CacheAwarePolicy(**NO_DECAY)).choose(y, reps, make_index({})).replica_id == "r0"
    # With it r0 would reach 960 > max(1.2 x 960 / 2, 160) = 576: r1, for either rule.
    for move in (True, False):
        d = _heavy_r0(BalancePolicy(beta=1.2, sessions_move=move, **NO_DECAY)).choose(y, reps, make_index({}))
        assert d.replica_id == "r1"
    # Nothing routed yet: no record, no rule (ties by id as without it).
    assert BalancePolicy(beta=1.2, **NO_DECAY).choose(y, reps, make_index({})).replica_id == "r0"
    with pytest.raises(ValueError, match="beta"):
        BalancePolicy(beta=0.9)


def test_pour_fills_the_lowest_bins_level():
    assert _pour([0.0, 0.0], 10.0) == 5.0
    assert _pour([6.0, 0.0, 2.0], 4.0) == 3.0  # 2 fills 0 -> 2, the last 2 lift both to 3
    assert _pour([6.0, 0.0, 2.0], 20.0) == pytest.approx(28.0 / 3)
    assert _pour([1.0, 1.0], 0.0) == 1.0
