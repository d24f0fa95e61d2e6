"""Prometheus metrics of one replica: vLLM's series where the meaning is the same, ours
(``unicache_replica_*``) for what vLLM has no name for.

Series under vLLM's names (types, buckets and meaning as vLLM 0.32's
``vllm/v1/metrics/loggers.py``; every series has the ``model_name`` label):

    * ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges, the engine's
      ``load()``), ``vllm:kv_cache_usage_perc`` (gauge, 0..1: blocks held by requests over
      capacity, which is vLLM's ``1 - free/total``: cached blocks nobody holds are free);
    * ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` (tokens of every
      request that got its first token; generation tokens as streamed);
    * ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens
      looked up in the prefix cache / of those, tokens served from it (``Usage``);
    * ``vllm:request_success_total{finished_reason}``;
    * histograms ``vllm:time_to_first_token_seconds`` (from the call reaching the replica to
      its first token), ``vllm:inter_token_latency_seconds`` (between consecutive messages
      of one sample) and ``vllm:e2e_request_latency_seconds`` (call to last message).

Ours: ``unicache_replica_info{replica,engine,eviction_policy}`` (always 1, for joins),
``unicache_replica_blocks{state=used|cached|free}``, ``unicache_replica_capacity_blocks``,
``unicache_replica_queue_blocks{queue}`` (eviction candidates per queue),
``unicache_replica_queue_evictions_total{queue}`` and ``unicache_replica_queue_hits_total{queue}``
(``CacheStateInfo.queue_evictions`` / ``queue_hits``),
``unicache_replica_refused_calls_total{transport=grpc|hop}`` (callers without the cluster
key), ``unicache_replica_hop_connections`` and ``unicache_replica_hop_streams_total``.

Invariants:
    * Gauges and the per-queue counters are read from the engine at scrape time, on the
      event loop that serves the endpoint (``metrics_server.py``): the engines'
      ``load``/``cache_state`` never block and are not thread-safe for every engine.
    * A request counts its prompt tokens, queries and hits once (at its first ``Usage``),
      whatever ``n`` is; a request that fails before any token counts nothing but is not a
      success either.
    * With ``request_series=False`` (the vLLM engine, whose own Prometheus logger exports
      the ``vllm:*`` series) no ``vllm:*`` series is defined here, so none is exported twice.

With a host tier (``--host-blocks``): ``unicache_replica_host_capacity_blocks`` and
``unicache_replica_host_used_blocks`` (gauges), ``unicache_replica_host_promotions_total``
(host hits), ``unicache_replica_host_demotions_total``, ``unicache_replica_host_evictions_total``
(``CacheStateInfo.host``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from unicache.replica.engines.api import EngineOutput, ServingEngine
    from unicache.replica.serving.server import ReplicaServer

# Bucket boundaries of vLLM 0.32 (vllm/v1/metrics/buckets.py), so histograms aggregate
# with vLLM's own.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
LABELS = ["model_name"]


class ReplicaCollector(Collector):
    """The scrape-time series: engine load, blocks and per-queue counts."""

    def __init__(self, engine: "ServingEngine", model_name: str, replica_id: str, engine_name: str, load_gauges: bool):
        self.engine = engine
        self.model_name = model_name
        self.replica_id = replica_id
        self.engine_name = engine_name
        self.load_gauges = load_gauges

    def collect(self) -> Iterator[Metric]:
        m = [self.model_name]
        state = self.engine.cache_state()
        info = GaugeMetricFamily(
            "unicache_replica_info", "Replica identity (always 1)", labels=["model_name", "replica", "engine", "eviction_policy"]
        )
        info.add_metric([self.model_name, self.replica_id, self.engine_name, state.eviction_policy], 1)
        yield info
        if self.load_gauges:
            load = self.engine.load()
            running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=LABELS)
            running.add_metric(m, load.running)
            waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=LABELS)
            waiting.add_metric(m, load.waiting)
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS)
            usage.add_metric(m, state.used_blocks / state.capacity_blocks if state.capacity_blocks else 0.0)
            yield from (running, waiting, usage)
        yield from self.cache_families(state)

    def cache_families(self, state) -> Iterator[Metric]:
        m = [self.model_name]
        blocks = GaugeMetricFamily(
            "unicache_replica_blocks", "KV blocks by state: used (held by requests), cached (hold a prefix), free (allocatable now)",
            labels=LABELS + ["state"],
        )
        for name, value in (("used", state.used_blocks), ("cached", state.cached_blocks), ("free", state.free_blocks)):
            blocks.add_metric(m + [name], value)
        capacity = GaugeMetricFamily("unicache_replica_capacity_blocks", "KV blocks in the pool", labels=LABELS)
        capacity.add_metric(m, state.capacity_blocks)
        queues = GaugeMetricFamily(
            "unicache_replica_queue_blocks", "Eviction candidates per eviction-policy queue", labels=LABELS + ["queue"]
        )
        for q in sorted(state.queue_sizes):
            queues.add_metric(m + [q], state.queue_sizes[q])
        evictions = CounterMetricFamily(
            "unicache_replica_queue_evictions", "Blocks evicted, by the eviction queue they left", labels=LABELS + ["queue"]
        )
        for q in sorted(state.queue_evictions):
            evictions.add_metric(m + [q], state.queue_evictions[q])
        hits = CounterMetricFamily(
            "unicache_replica_queue_hits", "Prefix-cache block hits on blocks waiting in each eviction queue", labels=LABELS + ["queue"]
        )
        for q in sorted(state.queue_hits):
            hits.add_metric(m + [q], state.queue_hits[q])
        yield from (blocks, capacity, queues, evictions, hits)
        if state.host is not None:
            yield from self.host_families(state.host)

    def host_families(self, host) -> Iterator[Metric]:
        """The host-memory tier under the pool (``CacheStateInfo.host``), when there is one."""
        m = [self.model_name]
        for name, doc, value in (
            ("unicache_replica_host_capacity_blocks", "Blocks in the host tier", host.capacity_blocks),
            ("unicache_replica_host_used_blocks", "Host-tier blocks holding a demoted prefix block", host.used_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(m, value)
            yield g
        for name, doc, value in (
            ("unicache_replica_host_promotions", "Host-tier blocks copied back to the pool by a prefix hit (host hits)", host.promotions),
            ("unicache_replica_host_demotions", "Pool victims demoted to the host tier instead of dropped", host.demotions),
            ("unicache_replica_host_evictions", "Blocks dropped from the host tier", host.evictions),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(m, value)
            yield c


class TransportCollector(Collector):
    """The serving side's scrape-time series (``ReplicaMetrics.watch_transports``): callers
    refused for lacking the cluster key, per transport, and the framed hop's open
    connections and streams started."""

    def __init__(self, model_name: str, server: "ReplicaServer"):
        self.model_name = model_name
        self.server = server

    def collect(self) -> Iterator[Metric]:
        m = [self.model_name]
        server = self.server
        refused = CounterMetricFamily(
            "unicache_replica_refused_calls",
            "Callers refused for lacking the cluster key (no, stale or forged credential; failed hop handshake)",
            labels=LABELS + ["transport"],
        )
        refused.add_metric(m + ["grpc"], server.auth.refused if server.auth is not None else 0)
        if server.hop is not None:
            refused.add_metric(m + ["hop"], server.hop.refusals.count)
        yield refused
        if server.hop is not None:
            conns = GaugeMetricFamily("unicache_replica_hop_connections", "Open framed-hop connections (routers)", labels=LABELS)
            conns.add_metric(m, len(server.hop.connections))
            streams = CounterMetricFamily("unicache_replica_hop_streams", "Generate streams started over the framed hop", labels=LABELS)
            streams.add_metric(m, server.hop.streams)
            yield from (conns, streams)


class ReplicaMetrics:
    """One replica's registry (its own, so several replicas can share a process in tests).

    Args:
        engine: the engine whose state the gauges read at scrape time.
        model_name: value of every series' ``model_name`` label.
        replica_id / engine_name: labels of ``unicache_replica_info``.
        request_series: define the ``vllm:*`` series here (default). False when the engine
            exports vLLM's own (the vLLM engine): then only ``unicache_replica_*`` series.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        engine: "ServingEngine",
        model_name: str,
        replica_id: str = "",
        engine_name: str = "torch",
        request_series: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.clock = clock
        self.request_series = request_series
        self.registry.register(ReplicaCollector(engine, model_name, replica_id, engine_name, load_gauges=request_series))
        self.insecure_transport = Gauge(
            "unicache_replica_insecure_transport",
            "1 when this replica serves routers without mutual TLS by the insecure_no_tls opt-out", registry=self.registry,
        )
        if not request_series:
            return
        r, m = self.registry, model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r).labels(m)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        ).labels(m)
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", LABELS, registry=r
        ).labels(m)
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS, registry=r
        ).labels(m)
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", LABELS + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
            buckets=TTFT_BUCKETS, registry=r,
        ).labels(m)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
            buckets=ITL_BUCKETS, registry=r,
        ).labels(m)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        ).labels(m)

    def watch_transports(self, server: "ReplicaServer") -> None:
        """Export ``server``'s refusals and hop connections (``TransportCollector``); once,
        after the server is built (it needs these metrics first)."""
        self.registry.register(TransportCollector(self.model_name, server))

    def start_request(self) -> "RequestTimer | None":
        """A timer for one request arriving now; None when this registry has no request series."""
        return RequestTimer(self, self.clock()) if self.request_series else None


@dataclass(slots=True)
class RequestTimer:
    """One request's progress: ``output`` for every engine output, ``finish`` once the
    stream ended normally. ``last`` maps a sample index to its previous message's time."""

    metrics: ReplicaMetrics
    start: float
    first: float | None = None
    counted_usage: bool = False
    last: dict[int, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def output(self, out: "EngineOutput") -> None:
        m = self.metrics
        now = m.clock()
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.start)
            prev = self.last.get(out.index)
            if prev is not None:
                m.itl.observe(now - prev)
            self.last[out.index] = now
        if out.usage is not None and not self.counted_usage:
            self.counted_usage = True
            u = out.usage
            m.prompt_tokens.inc(u.prompt_tokens)
            m.cache_queries.inc(u.prompt_tokens)
            m.cache_hits.inc(u.cached_tokens)
        if out.finished and out.finish_reason:
            self.reasons.append(out.finish_reason)

    def finish(self) -> None:
        """The stream ended without an error: one e2e observation, one success per sample."""
        m = self.metrics
        m.e2e.observe(m.clock() - self.start)
        for reason in self.reasons:
            m.success.labels(m.model_name, reason).inc()
