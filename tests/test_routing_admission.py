"""TTFT admission (unicache.router.routing.admission): exact estimates and admissible sets."""

from __future__ import annotations

import pytest

from unicache.router.routing.admission import TTFTAdmission
from unicache.router.routing.base import ReplicaLoad


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
