"""Generate helm/unicache/dashboards/unicache.json, the Grafana dashboard the chart ships.

Run ``python helm/tools/build_dashboard.py`` after editing; tests/deploy/test_helm_chart.py fails
when the committed JSON drifts from this script's output. The router panels read the
router's /metrics (router/observability/metrics.py; ``METRICS`` lists them), the replica panels every
replica's (replica/publishing/metrics.py; ``REPLICA_METRICS``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "unicache" / "dashboards" / "unicache.json"

# The router metrics the dashboard queries (histograms by their _bucket series).
METRICS = (
    "unicache_router_requests_total",
    "unicache_router_cached_tokens_total",
    "unicache_router_computed_tokens_total",
    "unicache_router_ttft_seconds_bucket",
    "unicache_router_routing_latency_seconds_bucket",
    "unicache_router_replica_hit_ratio",
    "unicache_router_replica_used_blocks",
    "unicache_router_replica_free_blocks",
    "unicache_router_replica_load",
    "unicache_router_routing_decisions_total",
)

# The replica metrics the replica panels query (replica/publishing/metrics.py; scraped by the
# PodMonitor). The vllm:* names are vLLM's, so vLLM's own dashboards read them too.
REPLICA_METRICS = (
    "unicache_replica_info",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "unicache_replica_queue_blocks",
    "unicache_replica_queue_evictions_total",
    "unicache_replica_queue_hits_total",
)

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'namespace="$namespace", service=~"$service"'
RATE = "[$__rate_interval]"


def q(metric: str, extra: str = "") -> str:
    """A selector for ``metric`` limited to the chosen namespace and router service."""
    return f"{metric}{{{SEL}{extra}}}"


REPLICA_SEL = 'namespace="$namespace"'
# Each replica series joined to its replica id (unicache_replica_info is 1 per scrape target).
JOIN = f' * on (namespace, pod, endpoint) group_left (replica) unicache_replica_info{{{REPLICA_SEL}}}'


def rq(metric: str) -> str:
    return f"{metric}{{{REPLICA_SEL}}}"


def per_replica(expr: str, by: str = "replica") -> str:
    """``expr`` (a replica series or its rate) labelled with the replica id, summed by ``by``."""
    return f"sum by ({by}) ({expr}{JOIN})"


def replica_quantile(p: float, metric: str) -> str:
    return f"histogram_quantile({p}, sum by (le, replica) (rate({rq(metric)}{RATE}){JOIN}))"


def quantile(p: float, metric: str) -> str:
    return f"histogram_quantile({p}, sum by (le) (rate({q(metric)}{RATE})))"


def timeseries(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, unit: str = "short", max_value=None):
    defaults: dict = {"unit": unit}
    if max_value is not None:
        defaults.update(min=0, max=max_value)
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": 12, "h": 8},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {"refId": chr(65 + i), "expr": expr, "legendFormat": legend, "datasource": DS}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def stat(pid: int, title: str, expr: str, x: int, unit: str):
    return {
        "id": pid,
        "type": "stat",
        "title": title,
        "datasource": DS,
        "gridPos": {"x": x, "y": 0, "w": 6, "h": 4},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [{"refId": "A", "expr": expr, "datasource": DS}],
    }


def build() -> dict:
    cached = f"sum(rate({q('unicache_router_cached_tokens_total')}{RATE}))"
    computed = f"sum(rate({q('unicache_router_computed_tokens_total')}{RATE}))"
    hits = per_replica(f"rate({rq('vllm:prefix_cache_hits_total')}{RATE})")
    queries = per_replica(f"rate({rq('vllm:prefix_cache_queries_total')}{RATE})")
    panels = [
        stat(1, "Requests / s", f"sum(rate({q('unicache_router_requests_total')}{RATE}))", 0, "reqps"),
        stat(2, "Prompt tokens served from cache", f"{cached} / clamp_min({cached} + {computed}, 1)", 6, "percentunit"),
        stat(3, "TTFT p50", quantile(0.5, "unicache_router_ttft_seconds_bucket"), 12, "s"),
        stat(4, "TTFT p99", quantile(0.99, "unicache_router_ttft_seconds_bucket"), 18, "s"),
        timeseries(
            5, "Cache hit ratio per replica",
            [(f"max by (replica) ({q('unicache_router_replica_hit_ratio')})", "{{replica}}")],
            0, 4, unit="percentunit", max_value=1,
        ),
        timeseries(
            6, "KV blocks used per replica",
            [(f"max by (replica) ({q('unicache_router_replica_used_blocks')})", "{{replica}}")], 12, 4,
        ),
        timeseries(
            7, "KV blocks free per replica",
            [(f"max by (replica) ({q('unicache_router_replica_free_blocks')})", "{{replica}}")], 0, 12,
        ),
        timeseries(
            8, "Routing decisions by reason",
            [(f"sum by (reason) (rate({q('unicache_router_routing_decisions_total')}{RATE}))", "{{reason}}")],
            12, 12, unit="reqps",
        ),
        timeseries(
            9, "Time to first token",
            [(quantile(p, "unicache_router_ttft_seconds_bucket"), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)],
            0, 20, unit="s",
        ),
        timeseries(
            10, "Prompt tokens per replica: cached vs computed",
            [
                (f"sum by (replica) (rate({q('unicache_router_cached_tokens_total')}{RATE}))", "{{replica}} cached"),
                (f"sum by (replica) (rate({q('unicache_router_computed_tokens_total')}{RATE}))", "{{replica}} computed"),
            ],
            12, 20,
        ),
        timeseries(
            11, "Outstanding requests per replica",
            [(f"max by (replica) ({q('unicache_router_replica_load')})", "{{replica}}")], 0, 28,
        ),
        timeseries(
            12, "Routing latency",
            [(quantile(p, "unicache_router_routing_latency_seconds_bucket"), f"p{int(p * 100)}") for p in (0.5, 0.99)],
            12, 28, unit="s",
        ),
        timeseries(
            13, "Replica: requests running / waiting",
            [(per_replica(rq("vllm:num_requests_running")), "{{replica}} running"),
             (per_replica(rq("vllm:num_requests_waiting")), "{{replica}} waiting")], 0, 36,
        ),
        timeseries(
            14, "Replica: KV cache usage (blocks held by requests)",
            [(per_replica(rq("vllm:kv_cache_usage_perc")), "{{replica}}")], 12, 36, unit="percentunit", max_value=1,
        ),
        timeseries(
            15, "Replica: prefix-cache hit ratio (tokens)",
            [(f"{hits} / clamp_min({queries}, 1)", "{{replica}}")],
            0, 44, unit="percentunit", max_value=1,
        ),
        timeseries(
            16, "Replica: prompt and generation tokens / s",
            [(per_replica(f"rate({rq('vllm:prompt_tokens_total')}{RATE})"), "{{replica}} prompt"),
             (per_replica(f"rate({rq('vllm:generation_tokens_total')}{RATE})"), "{{replica}} generation")], 12, 44,
        ),
        timeseries(
            17, "Replica: time to first token",
            [(replica_quantile(p, "vllm:time_to_first_token_seconds_bucket"), f"{{{{replica}}}} p{int(p * 100)}") for p in (0.5, 0.99)],
            0, 52, unit="s",
        ),
        timeseries(
            18, "Replica: inter-token and end-to-end latency",
            [(replica_quantile(0.99, "vllm:inter_token_latency_seconds_bucket"), "{{replica}} ITL p99"),
             (replica_quantile(0.99, "vllm:e2e_request_latency_seconds_bucket"), "{{replica}} E2E p99")],
            12, 52, unit="s",
        ),
        timeseries(
            19, "Replica: eviction-queue sizes (blocks)",
            [(per_replica(rq("unicache_replica_queue_blocks"), "replica, queue"), "{{replica}} {{queue}}")], 0, 60,
        ),
        timeseries(
            20, "Replica: evictions and hits by queue (blocks / s)",
            [(per_replica(f"rate({rq('unicache_replica_queue_evictions_total')}{RATE})", "replica, queue"), "{{replica}} {{queue}} evicted"),
             (per_replica(f"rate({rq('unicache_replica_queue_hits_total')}{RATE})", "replica, queue"), "{{replica}} {{queue}} hit")],
            12, 60,
        ),
    ]
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source", "current": {}},
        {
            "name": "namespace", "type": "query", "datasource": DS, "label": "Namespace", "refresh": 2, "current": {},
            "query": {"query": "label_values(unicache_router_requests_total, namespace)", "refId": "ns"},
        },
        {
            "name": "service", "type": "query", "datasource": DS, "label": "Router service", "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {},
            "query": {"query": 'label_values(unicache_router_requests_total{namespace="$namespace"}, service)', "refId": "svc"},
        },
    ]
    return {
        "uid": "unicache-serving",
        "title": "UniCache Serving",
        "description": "Per-replica KV cache state, routing decisions and TTFT, from the UniCache routers' /metrics. "
        "Generated by helm/tools/build_dashboard.py; do not edit by hand.",
        "tags": ["unicache", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
