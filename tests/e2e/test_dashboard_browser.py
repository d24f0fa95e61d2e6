"""The dashboard rendered by a real headless browser (Debian's Chromium) against a live
cluster (two whole replicas publishing to a private Redis, a router following them):
every chart exists in the rendered DOM with exactly the points the router's history holds,
and the history's figures are exactly what a known workload implies.

Also: the history's ring stays within its cap, and bucket quantiles follow Prometheus'
``histogram_quantile``.
"""

from __future__ import annotations

import math

import pytest

from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.observability.history import ClusterHistory, bucket_quantile
from unicache.router.observability.metrics import RouterMetrics
from unicache.router.routing.registry import make_routing_policy
from unicache.testing.browser import dump_dom, find_chromium, parse_charts
from unicache.testing.dashboard_stack import DashboardStack

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 2, "a cache-aware router keeps prefixes warm " * 2]


def test_bucket_quantile_interpolates_like_histogram_quantile():
    bounds = [0.1, 0.5, 1.0, math.inf]
    assert bucket_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert bucket_quantile(0.5, bounds, [2, 2, 0, 0]) == 0.1  # rank 2 ends the first bucket
    assert bucket_quantile(0.75, bounds, [2, 2, 0, 0]) == pytest.approx(0.3)  # halfway into (0.1, 0.5]
    assert bucket_quantile(0.99, bounds, [0, 0, 1, 3]) == 1.0  # +Inf bucket: highest finite bound


def test_history_ring_keeps_at_most_its_capacity():
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex(1000))
    cluster.upsert("r0", "127.0.0.1:1", static=True)
    metrics = RouterMetrics()
    now = [100.0]
    history = ClusterHistory(metrics, cluster, interval_s=1.0, capacity=3, clock=lambda: now[0])
    for i in range(5):
        metrics.labelled(metrics.decisions, "round_robin", "r0").inc(2 * i)
        now[0] += 2.0
        history.sample()
    body = history.to_json()
    assert (body["capacity"], [p["t"] for p in body["points"]]) == (3, [106.0, 108.0, 110.0])
    # 4, 6, 8 decisions over 2 s each; a static replica has no block figures.
    assert [p["replicas"]["r0"]["requests_per_s"] for p in body["points"]] == [2.0, 3.0, 4.0]
    assert [p["reasons"] for p in body["points"]] == [{"round_robin": 2.0}, {"round_robin": 3.0}, {"round_robin": 4.0}]
    assert body["points"][-1]["replicas"]["r0"]["used_blocks"] is None


def non_null(points: list[dict], rid: str, key: str) -> int:
    return sum(1 for p in points if rid in p["replicas"] and p["replicas"][rid][key] is not None)


@pytest.mark.slow
async def test_dashboard_draws_every_chart_with_the_history_in_headless_chromium():
    assert find_chromium() is not None, "needs Debian's chromium (apt-get install chromium; .ci/run does)"
    st = await DashboardStack.start(num_replicas=2)
    try:
        st.app.history.points.clear()
        st.sample()  # point 1: nothing routed yet
        served: dict[str, list[dict]] = {"replica-0": [], "replica-1": []}
        for _round in range(2):
            for prompt in PROMPTS * 2:  # round robin: prompt i always lands on replica i % 2
                resp = await st.complete(prompt)
                served[resp.headers["x-unicache-replica"]].append(resp.json()["usage"])
            await st.wait_heartbeats()
            st.sample()  # points 2 and 3
        st.sample()  # point 4: an idle interval
        history = (await st.client.get("/dashboard/history")).json()
        dom = await dump_dom(st.url + "/dashboard")
    finally:
        await st.close()

    points = history["points"]
    assert len(points) == 4
    # Round 2 on each replica: the same two requests again, their prompts now cached.
    for rid, usages in served.items():
        assert len(usages) == 4
        second = usages[2:]
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in second)
        prompt = sum(u["prompt_tokens"] for u in second)
        assert points[2]["replicas"][rid]["hit_ratio"] == pytest.approx(cached / prompt)
        assert cached > 0
        assert [p["replicas"][rid]["hit_ratio"] is None for p in points] == [True, False, False, True]
        assert [p["replicas"][rid]["requests_per_s"] > 0 for p in points] == [False, True, True, False]

    charts = parse_charts(dom)
    rids = ["replica-0", "replica-1"]
    assert sorted(charts.charts) == sorted(
        ["hit_ratio", "ttft", "requests_per_s", "routing_reasons"] + [f"{k}:{r}" for r in rids for k in ("blocks", "queues")]
    )
    assert charts.charts["hit_ratio"] == [(r, non_null(points, r, "hit_ratio")) for r in rids] == [(r, 2) for r in rids]
    assert charts.charts["ttft"] == [(f"{r} p50", 2) for r in rids] + [(f"{r} p99", 2) for r in rids]
    assert charts.charts["requests_per_s"] == [(r, 4) for r in rids]
    assert charts.charts["routing_reasons"] == [("round robin", 4)]  # no decision yet is a rate of 0
    for r in rids:
        assert charts.charts[f"blocks:{r}"] == [("used", 4), ("cached", 4), ("free", 4)]
        assert [label for label, _ in charts.charts[f"queues:{r}"]] == [
            "agent sessions", "chat sessions", "evict-first", "structural (templates)",
        ]
        assert charts.legends[f"blocks:{r}"] == "used cached free"
    assert charts.legends["ttft"] == "replica-0 p50 replica-1 p50 replica-0 p99 replica-1 p99"
