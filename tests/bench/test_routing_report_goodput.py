"""The routing report's goodput search: doubling to a bracket, then bisections in log u."""

from __future__ import annotations

import math

import pytest

from bench.routing_report import BISECT_STEPS, search_goodput


def test_bisection_narrows_the_doubling_bracket_to_the_crossing():
    replayed: list[float] = []

    def run_at(u: float) -> dict:
        replayed.append(u)
        return {"ttft_p90_s": u}  # p90 grows with the load: crosses an SLO of 1.3 s at u = 1.3

    g, saturated, seen = search_goodput(run_at, slo_s=1.3)
    assert BISECT_STEPS == 3
    # doubling 0.5 -> 1 -> 2 (fails), then 2^(1/2) (fails), 2^(1/4) and 2^(3/8) (pass)
    assert replayed == pytest.approx([0.5, 1.0, 2.0, 2 ** 0.5, 2 ** 0.25, 2 ** 0.375])
    assert not saturated
    assert g == pytest.approx(1.3, abs=2e-3)  # the doubling grid alone interpolated 1.3 between 1 and 2 as 1.231
    assert sorted(seen) == sorted(replayed)


@pytest.mark.parametrize(("slo_s", "expected_g", "expected_saturated", "replays"), [
    (100.0, 8.0, True, [0.5, 1.0, 2.0, 4.0, 8.0]),  # every scale passes: nothing to bisect
    (0.01, 0.0, False, [0.5, 0.25, 0.125, 0.0625]),  # even the lowest fails
])
def test_no_bisection_without_a_bracket(slo_s, expected_g, expected_saturated, replays):
    replayed: list[float] = []

    def run_at(u: float) -> dict:
        replayed.append(u)
        return {"ttft_p90_s": u}

    g, saturated, _ = search_goodput(run_at, slo_s=slo_s)
    assert (g, saturated) == (expected_g, expected_saturated)
    assert replayed == replays


def test_a_load_that_admits_nothing_fails_and_bisection_stays_below_it():
    def run_at(u: float) -> dict:
        return {"ttft_p90_s": math.nan if u >= 2 else 0.1}

    g, saturated, seen = search_goodput(run_at, slo_s=1.0)
    assert not saturated
    assert 2 ** 0.875 - 1e-9 <= g < 2  # the highest passing scale below the first NaN
    assert g == max(u for u, v in seen.items() if v["ttft_p90_s"] <= 1.0)


def test_the_cross_validation_candidates_and_their_load_weights():
    from bench.routing_report import CANDIDATES, candidates, code_default_candidate

    assert len(CANDIDATES) == 12 and CANDIDATES == candidates((1.0,))
    assert code_default_candidate() == "af2.0-fp0.5-ql1"  # the shipped default is a candidate
    more = candidates((1.0, 0.5))
    extra = {k: v for k, v in more.items() if k not in CANDIDATES}
    assert sorted(extra) == sorted(f"af{af}-fp{fp}-ql1-lw0.5" for af in (1.5, 2.0, 3.0) for fp in (0.5, 0.0))
    assert all(v["load_weight"] == 0.5 and v["queue_per_lane"] for v in extra.values())
    assert code_default_candidate(more) == "af2.0-fp0.5-ql1"
