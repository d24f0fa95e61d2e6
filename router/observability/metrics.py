"""Prometheus metrics of one router (its own registry, so several routers can share a
process, as tests do). Per-replica gauges are refreshed from the ``ClusterView`` at
scrape time, and ``forget_replica`` removes a departed replica's counter series, so no
series of a replica that left stays behind.

No label ever carries a key, a salt or a prompt: labels are API name, outcome, routing
reason and replica id only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from unicache.router.cluster.view import ClusterView
from unicache.router.routing.base import SharesRouterState

# Routing decisions are sub-millisecond; buckets from 10 us to 100 ms.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 1e-1)
# Time to first token: 1 ms to 60 s.
TTFT_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("unicache_router_requests", "Requests by API and outcome", ["api", "outcome"], registry=r)
        self.decisions = Counter(
            "unicache_router_routing_decisions", "Routing decisions by reason and replica", ["reason", "replica"], registry=r
        )
        self.retries = Counter("unicache_router_retries", "Attempts retried on another replica before a first token", registry=r)
        self.session_store = Counter(
            "unicache_router_session_store",
            "Shared session store calls (router/cluster/session_store.py) by op (load, save) and outcome (hit, miss, saved, error, rejected)",
            ["op", "outcome"],
            registry=r,
        )
        self.terms_exchange = Counter(
            "unicache_router_terms_exchange",
            "Routed-event batches shared with the cluster's other routers (router/cluster/terms_exchange.py) by outcome "
            "(sent, applied, rejected, error)",
            ["outcome"],
            registry=r,
        )
        self.hop_connections = Counter(
            "unicache_router_hop_connections",
            "Framed replica hop connections (unicache/contract/hop.py) by outcome (connected; refused: the handshake failed on "
            "the cluster key; unreachable: no connection or no handshake; lost: an established one dropped)",
            ["outcome"],
            registry=r,
        )
        self.first_token_timeouts = Counter(
            "unicache_router_first_token_timeouts",
            "Attempts cancelled because the replica sent nothing within its derived first-token timeout",
            ["replica"],
            registry=r,
        )
        self.quarantines = Counter(
            "unicache_router_quarantines", "Times a replica was quarantined (refused or stalled)", ["replica"], registry=r
        )
        self.broken_streams = Counter(
            "unicache_router_broken_streams",
            "Responses cut short by their backend failing after the first token (the client got an error event and the "
            "end of the stream), by replica and kind (unavailable: it went away; deadline; upstream)",
            ["replica", "kind"], registry=r,
        )
        self.limit_rejections = Counter(
            "unicache_router_limit_rejections", "Requests refused by a per-tenant limit, by limit name", ["limit"], registry=r
        )
        self.matched_tokens = Counter(
            "unicache_router_matched_tokens", "Prompt tokens the locality index expected to hit", registry=r
        )
        self.cached_tokens = Counter(
            "unicache_router_cached_tokens", "Prompt tokens the replicas served from cache", ["replica"], registry=r
        )
        self.computed_tokens = Counter(
            "unicache_router_computed_tokens", "Prompt tokens the replicas computed", ["replica"], registry=r
        )
        self.routing_latency = Histogram(
            "unicache_router_routing_latency_seconds",
            "Time to hash, classify and choose a replica (per attempt)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "unicache_router_ttft_seconds",
            "Time from the request reaching the router to the replica's first message",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.replica_ttft = Histogram(
            "unicache_router_replica_ttft_seconds",
            "Time from the request reaching the router to the first message, by the replica that sent it",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.replica_hit_ratio = Gauge(
            "unicache_router_replica_hit_ratio", "Replica block hit ratio (heartbeat)", ["replica"], registry=r
        )
        self.replica_load = Gauge(
            "unicache_router_replica_load", "Replica outstanding requests (max of router and replica view)", ["replica"], registry=r
        )
        self.replica_used_blocks = Gauge(
            "unicache_router_replica_used_blocks", "Replica KV blocks in use (heartbeat)", ["replica"], registry=r
        )
        self.replica_free_blocks = Gauge(
            "unicache_router_replica_free_blocks", "Replica KV blocks allocatable now (heartbeat)", ["replica"], registry=r
        )
        self.replica_in_flight = Gauge(
            "unicache_router_replica_in_flight", "Requests this router has in flight per replica", ["replica"], registry=r
        )
        self.replica_quarantined = Gauge(
            "unicache_router_replica_quarantined", "1 while routing skips the replica until it answers a probe", ["replica"], registry=r
        )
        self.replica_queue_share = Gauge(
            "unicache_router_replica_queue_share",
            "Uncached share of the replica's queue the routing policy weighs: of the routers' requests there "
            "without a first token, uncached over whole prompt tokens (1: none wait; cache_aware's queue share)",
            ["replica"], registry=r,
        )
        self.indexed_blocks = Gauge(
            "unicache_router_indexed_blocks", "Blocks the locality index holds per replica", ["replica"], registry=r
        )
        self.replicas = Gauge("unicache_router_replicas", "Live replicas", registry=r)
        self.redis_connected = Gauge("unicache_router_redis_connected", "1 when the Redis subscriber is connected", registry=r)
        self.prefix_reuse = Gauge(
            "unicache_router_prefix_reuse",
            "Prompts tokenized reusing kept prefixes (router/request_path/prefix_tokens.py), by kind: hits (encodes that "
            "reused a prefix), misses (encodes with message delimiters or word cuts and nothing kept), reused_tokens (ids not encoded "
            "again), kept_tokens (ids kept now), mismatches (1: a reuse differed from a whole encode; reuse is off)",
            ["kind"], registry=r,
        )
        self.insecure_transport = Gauge(
            "unicache_router_insecure_transport",
            "1 when this router talks to replicas without mutual TLS by the insecure_no_tls opt-out", registry=r,
        )
        # the cost model (router/routing/cost_model.py): each backend's fitted costs and
        # how far its TTFT prediction at dispatch was from the measured TTFT
        self.backend_cost = Gauge(
            "unicache_router_backend_cost_seconds",
            "A backend's fitted costs in seconds by term: prefill_base (a), prefill_per_token (b), per_outstanding (s, "
            "per request outstanding at dispatch), decode_base and decode_per_seq (inter-token time at a batch)",
            ["replica", "term"], registry=r,
        )
        self.backend_cost_fitted = Gauge(
            "unicache_router_backend_cost_fitted", "1 when the backend's costs are fitted from its requests, 0 while a prior",
            ["replica"], registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "unicache_router_ttft_prediction_error_seconds",
            "|predicted - measured| time to first token per request, the prediction made at dispatch by the cost model",
            ["replica"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.backend_overdue_factor = Gauge(
            "unicache_router_backend_overdue_factor",
            "Above 1 while a request on the backend has waited for its first token beyond the prediction's noise: its "
            "TTFT costs are raised by this factor (1: none)",
            ["replica"], registry=r,
        )
        self.backend_overdue_seconds = Counter(
            "unicache_router_backend_overdue_seconds_total",
            "Seconds the backend was priced overdue (its overdue factor above 1): how often the router steered away "
            "from requests held beyond the prediction's noise",
            ["replica"], registry=r,
        )
        self.ttft_prediction_rel_error = Gauge(
            "unicache_router_ttft_prediction_relative_error",
            "Mean |predicted - measured| / measured TTFT per backend (exponential average over about 16 requests)",
            ["replica"], registry=r,
        )
        self._children: dict[tuple, object] = {}
        # Position of the ``replica`` label in each counter that has one.
        self._replica_label_at = {
            self.decisions: 1, self.cached_tokens: 0, self.computed_tokens: 0, self.first_token_timeouts: 0, self.quarantines: 0, self.broken_streams: 0,
            self.replica_ttft: 0, self.ttft_prediction_error: 0, self.backend_overdue_seconds: 0,
        }

    def labelled(self, metric, *values: str):
        """``metric.labels(*values)``, remembered: the request path labels the same few
        children on every request, and ``labels()`` validates and takes a lock each time.
        Only for the counters and histograms (``refresh`` clears the per-replica gauges, so those are
        labelled afresh); every counter child with a replica label is made here, so
        ``forget_replica`` finds it."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_prediction(self, replica_id: str, predicted_s: float, measured_s: float) -> None:
        """One TTFT the cost model predicted at dispatch against the measured one."""
        self.labelled(self.ttft_prediction_error, replica_id).observe(abs(predicted_s - measured_s))

    def observe_overdue(self, replica_id: str, seconds: float) -> None:
        """``replica_id`` was priced overdue for ``seconds`` more."""
        self.labelled(self.backend_overdue_seconds, replica_id).inc(seconds)

    def forget_replica(self, replica_id: str) -> None:
        """Remove every counter series labelled with ``replica_id`` (it left the cluster);
        a replica that comes back later starts its series from zero."""
        for key in list(self._children):
            metric, values = key
            at = self._replica_label_at.get(metric)
            if at is not None and values[at] == replica_id:
                del self._children[key]
                metric.remove(*values)

    def refresh(self, cluster: ClusterView) -> None:
        """Set the per-replica gauges from the cluster view."""
        per_replica = (
            self.replica_hit_ratio, self.replica_used_blocks, self.replica_free_blocks,
            self.replica_load, self.replica_in_flight, self.indexed_blocks, self.replica_quarantined,
            self.replica_queue_share, self.backend_cost, self.backend_cost_fitted, self.backend_overdue_factor,
            self.ttft_prediction_rel_error,
        )
        for g in per_replica:
            g.clear()
        for rid, row in cluster.cost_model.snapshot().items():
            if rid not in cluster.replicas:
                continue
            for term in ("prefill_base", "prefill_per_token", "per_outstanding", "decode_base", "decode_per_seq"):
                self.backend_cost.labels(rid, term).set(row[term + "_s"])
            self.backend_cost_fitted.labels(rid).set(1 if row["fitted"] else 0)
            self.backend_overdue_factor.labels(rid).set(row["overdue_factor"])
            self.ttft_prediction_rel_error.labels(rid).set(row["ttft_rel_error"])
        policy = cluster.policy
        shares = policy.queue_shares() if isinstance(policy, SharesRouterState) else None
        for load in cluster.all_loads():
            rec = cluster.replicas[load.replica_id]
            rid = load.replica_id
            self.replica_quarantined.labels(rid).set(1 if rec.quarantined else 0)
            self.replica_load.labels(rid).set(load.outstanding)
            self.replica_in_flight.labels(rid).set(rec.in_flight)
            self.indexed_blocks.labels(rid).set(cluster.index.num_blocks(rid))
            if shares is not None:
                self.replica_queue_share.labels(rid).set(shares.get(rid, 1.0))
            if rec.heartbeat is not None:
                cache = rec.heartbeat.cache
                self.replica_hit_ratio.labels(rid).set(cache.hit_ratio)
                self.replica_used_blocks.labels(rid).set(cache.used_blocks)
                self.replica_free_blocks.labels(rid).set(cache.free_blocks)
        self.replicas.set(len(cluster.replicas))
        self.redis_connected.set(1 if cluster.redis_connected else 0)

    def render(self, cluster: ClusterView) -> bytes:
        self.refresh(cluster)
        return generate_latest(self.registry)

