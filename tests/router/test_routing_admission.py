"""TTFT admission (unicache.router.routing.cache_aware.admission): exact estimates and admissible sets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware.admission import MATCHES_FIRST_MIN_REPLICAS, TTFTAdmission


def test_estimate_is_uncached_tokens_plus_queue_over_lanes():
    a = TTFTAdmission(factor=2.0, prefill_lanes=4)
    r = ReplicaLoad("r0", running=7, queued_prefill_tokens=400)
    assert a.estimate(160, 16, 3, r) == 112 + 100  # running requests do not count
    assert a.estimate(160, 16, 20, r) == 100  # a match beyond the prompt caches it all
    assert TTFTAdmission(prefill_lanes=1).estimate(160, 16, 0, r) == 560


def test_admissible_within_factor_of_the_best_in_input_order():
    a = TTFTAdmission(factor=2.0, prefill_lanes=4)
    reps = [ReplicaLoad("r2", queued_prefill_tokens=600), ReplicaLoad("r0"), ReplicaLoad("r1", queued_prefill_tokens=400)]
    # Estimates: r2 160 - 64 + 150 = 246, r0 160, r1 160 + 100 = 260; cap 2 x 160 = 320.
    assert [r.replica_id for r in a.admissible(reps, 160, 16, {"r2": 4})] == ["r2", "r0", "r1"]
    # r0 holds the whole prompt: its estimate is 0 and nothing else is within 2 x 0.
    assert [r.replica_id for r in a.admissible(reps, 160, 16, {"r0": 10})] == ["r0"]
    # Factor 1.5: cap 240, r2 (246) and r1 (260) drop out.
    assert [r.replica_id for r in TTFTAdmission(1.5).admissible(reps, 160, 16, {"r2": 4})] == ["r0"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="factor"):
        TTFTAdmission(factor=0.5)
    with pytest.raises(ValueError, match="prefill_lanes"):
        TTFTAdmission(prefill_lanes=0)


def _full_pass(a: TTFTAdmission, replicas, n, bs, matches, share):
    """The rule as the module docstring states it, over every replica (the reference)."""
    est = [max(0, n - bs * matches.get(r.replica_id, 0))
           + (r.queued_prefill_tokens * share.get(r.replica_id, 1.0) if share else r.queued_prefill_tokens) / a.prefill_lanes
           for r in replicas]
    cap = a.factor * min(est)
    return [r for r, e in zip(replicas, est) if e <= cap]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_replicas=st.integers(32, 90), factor=st.sampled_from([1.0, 1.5, 2.0, 3.0]),
       lanes=st.integers(1, 4), bs=st.sampled_from([1, 16]), n=st.integers(0, 4000), shared=st.booleans())
def test_a_fleet_decided_among_its_matching_replicas_gets_the_full_pass_result(data, n_replicas, factor, lanes, bs, n, shared):
    """Fleets of at least MATCHES_FIRST_MIN_REPLICAS take the matching-replicas path when it
    applies; its result must be the full pass's, the same objects in the same order
    (queues of 0 make ties at the cap; matches may name replicas not offered). One
    admission object decides several fleets in turn, whose membership and order change
    between calls (its kept positions must never point at the wrong replica)."""
    assert n_replicas >= MATCHES_FIRST_MIN_REPLICAS
    queue = st.sampled_from([0, 0, 7, 100, 1000, 30_000])
    everyone = [ReplicaLoad(f"r{i:03d}", queued_prefill_tokens=data.draw(queue)) for i in range(n_replicas + 8)]
    ids = [r.replica_id for r in everyone] + ["gone"]
    a = TTFTAdmission(factor, lanes)
    for _ in range(3):
        reps = data.draw(st.permutations(everyone))[: n_replicas + data.draw(st.integers(0, 8))]
        if data.draw(st.booleans()):
            reps.sort(key=lambda r: r.replica_id)  # the live router's order
        matches = data.draw(st.dictionaries(st.sampled_from(ids), st.integers(0, n // max(bs, 1) + 3), max_size=12))
        share = data.draw(st.dictionaries(st.sampled_from(ids), st.sampled_from([0.0, 0.1, 1 / 3, 1.0]), max_size=20)) if shared else None
        assert a.admissible(reps, n, bs, matches, share) == _full_pass(a, reps, n, bs, matches, share)


def test_the_matching_replicas_decide_only_when_no_other_can_be_admissible():
    a = TTFTAdmission(factor=2.0, prefill_lanes=4)
    reps = [ReplicaLoad(f"r{i:02d}", queued_prefill_tokens=40) for i in range(40)]
    # r07 holds 9 of 10 blocks: estimate 16 + 10 = 26, cap 52 < 160: r07 alone, found among the matches.
    assert [r.replica_id for r in a.admissible(reps, 160, 16, {"r07": 9, "r03": 1})] == ["r07"]
    assert a._among_matches(reps, 160, 16, {"r07": 9, "r03": 1}, None) == [reps[7]]
    # r07 holds 5 of 10: estimate 90, cap 180 >= 160: every replica (170) is within it; the full pass decides.
    assert a._among_matches(reps, 160, 16, {"r07": 5}, None) is None
    assert len(a.admissible(reps, 160, 16, {"r07": 5})) == 40
