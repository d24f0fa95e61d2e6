"""bench.live_eviction's harness without servers: windows, the simulator's side, the report
(the live side ran at a tiny size: docs/eviction.md)."""

from __future__ import annotations

from bench.live_eviction import Row, report, simulate, source_trace, windows
from bench.live_ab_workload import build_requests
from unicache.testing.tiny_hf_model import WORDS


def test_windows_slide_by_stride_and_stop_at_the_trace_end():
    trace = list(range(10))
    assert windows(trace, 4, 3, 5) == [(0, [0, 1, 2, 3]), (3, [3, 4, 5, 6]), (6, [6, 7, 8, 9]), (9, [9])]


def test_the_simulators_prediction_is_deterministic_and_orders_the_policies():
    trace = source_trace("template", 0, 0, 120.0)[:60]
    requests = build_requests(trace, list(WORDS), 16, 4)
    a = simulate(requests, 16, True, 64)
    assert a == simulate(requests, 16, True, 64)
    assert set(a) == {"unicache", "lru"} and a["unicache"] > a["lru"] > 0


def test_the_report_has_one_row_per_window_and_pool():
    rows = [Row("chat", 0, "sent", 24, 178, 0.1, 0.4472, 0.3065, 0.4472, 0.3065)]
    text = report(rows, "python -m bench.live_eviction --sources chat")
    assert "| chat | 0 | sent | 24 | 178 | 10% | 44.72 | 30.65 | 1.46 | 44.72 | 30.65 |" in text
