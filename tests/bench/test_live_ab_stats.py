"""The live A/B's bootstrap intervals and verdicts: exact on fixed data."""

from __future__ import annotations

import pytest

from bench.live_ab_stats import bootstrap_ci, hit_ratio_ci, ttft_ci, verdict


def test_a_constant_sample_has_a_point_interval_and_a_seeded_one_repeats():
    assert ttft_ci([0.05] * 20, 50) == (0.05, 0.05)
    xs = [i / 100 for i in range(1, 101)]
    assert ttft_ci(xs, 90) == ttft_ci(xs, 90)
    lo, hi = ttft_ci(xs, 50)
    assert lo < 0.505 < hi and hi - lo < 0.25
    assert bootstrap_ci([], len) is None


def test_the_hit_ratio_weighs_prompt_tokens():
    assert hit_ratio_ci([(10, 100), (90, 100)] * 10, resamples=200)[0] < 0.5 < hit_ratio_ci([(10, 100), (90, 100)] * 10, resamples=200)[1]
    assert hit_ratio_ci([(0, 0)]) == (0.0, 0.0)
    assert hit_ratio_ci([(30, 100)] * 5) == (pytest.approx(0.3), pytest.approx(0.3))


def test_overlapping_intervals_are_a_tie():
    assert verdict((0.1, 0.2), (0.15, 0.3), lower_is_better=True) == "tie"
    assert verdict((0.1, 0.2), (0.25, 0.3), lower_is_better=True) == "better"
    assert verdict((0.1, 0.2), (0.25, 0.3), lower_is_better=False) == "worse"
    assert verdict((0.5, 0.6), (0.1, 0.2), lower_is_better=False) == "better"
    assert verdict(None, (0.1, 0.2), lower_is_better=True) == "tie"


def _runs(ttft_s: float, cached: int, n: int = 40) -> list[dict]:
    from bench.live_ab_client import Outcome

    outs = [Outcome(i, ttft_s=ttft_s + 0.001 * (i % 5), e2e_s=ttft_s + 0.1, cached_tokens=cached, prompt_tokens=100, tokens=4)
            for i in range(n)]
    return [{"outcomes": outs, "hits": cached * n, "queries": 100 * n, "cpu_s": 0.1, "idle_cpu": 0.0,
             "server_ttft_sum_s": 0.045 * n, "server_ttft_count": n, "router_ttft_sum_s": 0.048 * n, "router_ttft_count": n,
             "runqueue_wait_s": 0.002 * n, "replay_s": 10.0, "backends": 2, "router_overdue_s": 0.5}]


def test_the_report_gives_intervals_and_calls_overlaps_ties():
    from bench.live_ab_report import arm_fields, markdown, rate_fields, verdicts

    arms = {"ours": arm_fields([rate_fields(_runs(0.050, 40), 1.0, 1.0)]),
            "round-robin": arm_fields([rate_fields(_runs(0.080, 40), 1.0, 1.0)]),
            "ours-lru": arm_fields([rate_fields(_runs(0.0505, 20), 1.0, 1.0)])}
    # TTFTs of 50-54 ms, 8 requests each: the median's interval is one ms either side
    assert arms["ours"]["ttft_p50_ci_s"] == (pytest.approx(0.051), pytest.approx(0.053))
    assert arms["ours"]["hit_ratio_ci"] == (pytest.approx(0.4), pytest.approx(0.4))
    v = verdicts(arms)
    assert v == {"round-robin": [{"rate_scale": 1.0, "hit_ratio": "tie", "ttft_p50_s": "better", "ttft_p90_s": "better"}],
                 "ours-lru": [{"rate_scale": 1.0, "hit_ratio": "better", "ttft_p50_s": "tie", "ttft_p90_s": "tie"}]}
    rep = {"servers": 2, "trace_name": "t.jsonl", "requests_per_run": 40, "tokens_per_id": 32, "block_size": 32,
           "pool_blocks": 10, "unique_blocks": 100, "max_output_tokens": 16, "rates": [1.0], "rounds": 3,
           "unloaded_ttft_s": 0.02, "slo_multiple": 3, "slo_ttft_s": 0.06, "peers": {}, "vllm_version": "x",
           "regime": "decode-heavy", "arms": arms, "verdicts": v, "command": "c", "host": "h", "cpus": 2, "commit": "c",
           "date": "d", "wall_s": 60.0,
           "sim_fitted": {"command": "unicache sim --calibration cal.json", "arms": {"ours": {"rates": [
               {"rate_scale": 1.0, "hit_ratio": 0.41, "ttft_p90_s": 0.07}]}}}}
    md = markdown(rep)
    assert "| ours | 1 | 0.400 | - / 0.410 | 52.0 | 54.0 | - / - / 70.0 |" in md
    assert "| round-robin | 1 | [0.400, 0.400] | [81, 83] | [83, 84] | tie / better / better |" in md
    # client TTFT mean 52 ms (50-54 in equal parts) beside the router's 48 and vLLM's own 45 ms
    # ... and 2.5 ms of CPU, 2.0 ms of run-queue wait per request; its 2 backends priced
    # overdue for 0.5 s of their 2 x 10 s: 2.5%
    assert arms["ours"]["router_overdue_share"] == pytest.approx(0.025)
    assert "| 54.0 | 52.0 / 48.0 / 45.0 | 150.0 | 2.50 | 2.0 | 0.0 | 2.5 |" in next(line for line in md.splitlines() if line.startswith("| ours | 1 "))
    assert "Regime: decode-heavy." in md and "the cost model our router fitted live" in md


def test_the_servers_ttft_histogram_is_summed_over_label_sets():
    from bench.live_ab_client import TTFT_HISTOGRAM, FleetCounters, series_total, histogram_totals

    page = "\n".join([
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 3.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="a"} 4.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="a"} 0.5',
        'vllm:time_to_first_token_seconds_count{engine="1",model_name="a"} 2.0',
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="a"} 0.25',
        'vllm:time_to_first_token_seconds_created{engine="1"} 1.7e9',
        'vllm:e2e_request_latency_seconds_sum{engine="0"} 9.0',
    ])
    assert histogram_totals(page, TTFT_HISTOGRAM) == (0.75, 6.0)
    counters = 'x_total{replica="a"} 1.5\nx_total{replica="b"} 2.0\nx_created{replica="a"} 1.7e9\nxx_total 9.0'
    assert series_total(counters, "x_total") == 3.5 and series_total("", "x_total") == 0.0
    assert FleetCounters(5, 10, 1.0, 8).minus(FleetCounters(1, 2, 0.25, 2)) == (4, 8, 0.75, 6)
    assert FleetCounters(5, 10, 1.0, 8).plus(FleetCounters(1, 2, 0.25, 2)) == (6, 12, 1.25, 10)


def test_a_process_trees_run_queue_wait_is_read_from_schedstat():
    import os

    from bench.live_ab_client import tree_runqueue_wait_s

    with open(f"/proc/{os.getpid()}/schedstat") as f:
        own = int(f.read().split()[1]) / 1e9
    # this process's threads (and no child) together waited at least what its main thread did
    assert tree_runqueue_wait_s(os.getpid()) >= own * 0.999
    assert tree_runqueue_wait_s(2 ** 22 + 1) == 0.0  # no such process
