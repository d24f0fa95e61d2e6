"""bench.studies.capacity_shift names exactly the traces whose capacity its fraction moved
from the tuned one (the others sit at the floor of twice their largest request)."""

from __future__ import annotations

from bench.studies.capacity_shift import TUNED_CAPACITY_FRAC, moved_traces, notes


def test_only_traces_above_the_floor_at_either_fraction_move():
    assert TUNED_CAPACITY_FRAC == 0.02
    results = [
        # 2% of 10,000 = 200 < floor 300; 5% = 500 > 300: moved 300 -> 500
        {"trace": "plain-p0-s0", "family": "plain", "unique_blocks": 10_000, "capacity_floor_blocks": 300,
         "capacity_blocks": 500},
        # floored at both fractions (5% of 4,000 = 200 < 400): not moved
        {"trace": "chat-p0-s0", "family": "chat", "unique_blocks": 4_000, "capacity_floor_blocks": 400,
         "capacity_blocks": 400},
        # above the floor at both: 2% = 1,000, 5% = 2,500
        {"trace": "mooncake-p1-s0", "family": "mooncake", "unique_blocks": 50_000, "capacity_floor_blocks": 40,
         "capacity_blocks": 2_500},
    ]
    report = {"results": results, "traces": 3}
    assert moved_traces(report) == [
        {"trace": "plain-p0-s0", "family": "plain", "tuned_blocks": 300, "blocks": 500},
        {"trace": "mooncake-p1-s0", "family": "mooncake", "tuned_blocks": 1_000, "blocks": 2_500},
    ]
    text = notes(report)
    assert "on 2 of 3 traces (families mooncake, plain)" in text
    assert "- plain-p0-s0: 300 -> 500 blocks per replica" in text
