"""``DecayingTotals``: the true totals of a dict decayed at every step, kept in O(1) per step."""

from __future__ import annotations

import random

import pytest

from unicache.router.routing.cache_aware import decaying
from unicache.router.routing.cache_aware.decaying import DecayingTotals


def test_totals_decay_add_subtract_and_clamp_at_zero():
    t = DecayingTotals()
    t.add("r0", 8.0)
    t.decay(0.5)
    t.add("r1", 3.0)
    assert t.as_dict() == {"r0": 4.0, "r1": 3.0}
    t.subtract("r0", 1.0)
    t.subtract("r1", 5.0)  # clamped
    t.subtract("r9", 1.0)  # no total: nothing
    assert t.as_dict() == {"r0": 3.0, "r1": 0.0}
    assert ("r1" in t, "r9" in t, len(t), sorted(t)) == (True, False, 2, ["r0", "r1"])
    assert t.total * t.unit == 3.0  # raw units
    assert t.get("r9", 7.0) == 7.0 and t.pop("r0") == 3.0 and t.pop("r0") is None and t.total == 0.0
    # raw values compare as the true totals do (what the churn term reads)
    t.add("r2", 6.0)
    t.decay(0.25)
    t.add("r3", 0.5)
    assert t.unit == 0.125 and t.raw["r2"] / t.raw["r3"] == 3.0 and t.as_dict() == {"r1": 0.0, "r2": 1.5, "r3": 0.5}


@pytest.mark.parametrize("renormalise_at", [1e100, 1e3])
def test_matches_multiplying_every_total_at_every_step(monkeypatch, renormalise_at):
    """Against the O(keys) definition, over 2,000 random steps (1e3: the raw values are
    scaled back every few steps, which must not change a total)."""
    monkeypatch.setattr(decaying, "RENORMALISE_AT", renormalise_at)
    rng = random.Random(0)
    t, naive = DecayingTotals(), {}
    for _ in range(2000):
        f = rng.choice((0.99, 0.9, 0.5))
        t.decay(f)
        for k in naive:
            naive[k] *= f
        k, x = f"r{rng.randrange(8)}", rng.uniform(0, 100)
        if rng.random() < 0.7:
            t.add(k, x)
            naive[k] = naive.get(k, 0.0) + x
        elif k in naive:
            t.subtract(k, x)
            naive[k] = max(0.0, naive[k] - x)
        assert t.unit >= 1.0 / renormalise_at
        assert t.total == pytest.approx(sum(t.raw.values()), rel=1e-9)
        if rng.random() < 0.01:
            gone = f"r{rng.randrange(8)}"
            assert t.pop(gone) == pytest.approx(naive.pop(gone, None), rel=1e-9) if gone in naive else t.pop(gone) is None
    got = t.as_dict()
    assert got.keys() == naive.keys()
    for k, v in naive.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-9)
