"""The router's recent history for the dashboard: a bounded ring of periodic samples.

Every ``interval_s`` (default 2 s) ``ClusterHistory.sample`` appends one point, and the
oldest falls out once ``capacity`` points are kept (default 900: 30 minutes at 2 s). A
point holds, per replica, what the dashboard charts:

    * ``hit_ratio``: prompt tokens served from cache over prompt tokens, of the requests
      that finished in the interval (the router's ``cached_tokens`` / ``computed_tokens``
      counters); None when none finished;
    * ``used_blocks`` / ``cached_blocks`` / ``free_blocks`` / ``capacity_blocks`` and
      ``queue_sizes`` from the replica's last heartbeat (None for a static replica);
    * ``ttft_p50`` / ``ttft_p99`` in seconds, estimated from the interval's bucket counts of
      ``unicache_router_replica_ttft_seconds`` as Prometheus' ``histogram_quantile`` does
      (linear within a bucket); None when no request got its first token;
    * ``requests_per_s``: routing decisions for the replica per second;

and cluster-wide ``reasons``: routing decisions per second by reason.

Invariants:
    * At most ``capacity`` points are held (a ``deque`` with ``maxlen``), whatever runs.
    * Interval figures are differences of cumulative counters between consecutive samples;
      a counter that went backwards (its replica left and came back, ``forget_replica``)
      counts from zero.
    * ``sample`` reads only the router's own registry and cluster view: no I/O.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from unicache.router.cluster.view import ClusterView
from unicache.router.observability.metrics import RouterMetrics

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
DEFAULT_CAPACITY = 900


def bucket_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """The ``q`` quantile of a histogram given per-bucket (not cumulative) counts with upper
    bounds ``bounds`` (the last may be +Inf), as Prometheus' ``histogram_quantile``: linear
    interpolation inside the bucket, the lower bound of the first bucket is 0, and a rank in
    the +Inf bucket answers the highest finite bound. None when the counts are all zero."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    lower = 0.0
    for upper, count in zip(bounds, counts):
        if count > 0 and seen + count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
        if not math.isinf(upper):
            lower = upper
    return lower


class _Cumulative:
    """Cumulative counter values by key; ``delta`` is the change since the last call."""

    def __init__(self):
        self.last: dict[Any, float] = {}

    def delta(self, key: Any, value: float) -> float:
        prev = self.last.get(key, 0.0)
        self.last[key] = value
        return value - prev if value >= prev else value


class ClusterHistory:
    """See the module docstring.

    Args:
        metrics: the router's metrics (counters read by name from its registry).
        cluster: the router's cluster view (heartbeats).
        interval_s: sampling period of ``run``.
        capacity: most points kept.
        clock: wall-clock seconds for the points' timestamps.
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        cluster: ClusterView,
        interval_s: float = DEFAULT_INTERVAL_S,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.time,
    ):
        if interval_s <= 0 or capacity <= 0:
            raise ValueError("interval_s and capacity must be positive")
        self.metrics = metrics
        self.cluster = cluster
        self.interval_s = interval_s
        self.capacity = capacity
        self.clock = clock
        self.points: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._counters = _Cumulative()
        self._last_t: float | None = None

    def _counter_values(self) -> dict[str, dict[tuple, float]]:
        """``family -> labels tuple -> value`` of the counters and histogram buckets used."""
        wanted = {
            "unicache_router_routing_decisions_total": ("reason", "replica"),
            "unicache_router_cached_tokens_total": ("replica",),
            "unicache_router_computed_tokens_total": ("replica",),
            "unicache_router_replica_ttft_seconds_bucket": ("replica", "le"),
        }
        out: dict[str, dict[tuple, float]] = {name: {} for name in wanted}
        for family in self.metrics.registry.collect():
            for s in family.samples:
                labels = wanted.get(s.name)
                if labels is not None:
                    out[s.name][tuple(s.labels[k] for k in labels)] = s.value
        return out

    def sample(self) -> dict[str, Any]:
        """Append one point (see the module docstring) and return it."""
        now = self.clock()
        elapsed = now - self._last_t if self._last_t is not None else self.interval_s
        self._last_t = now
        per_s = 1.0 / elapsed if elapsed > 0 else 0.0
        values = self._counter_values()
        d = self._counters.delta
        reasons: dict[str, float] = {}
        requests: dict[str, float] = {}
        for (reason, rid), v in values["unicache_router_routing_decisions_total"].items():
            n = d(("decisions", reason, rid), v)
            reasons[reason] = reasons.get(reason, 0.0) + n * per_s
            requests[rid] = requests.get(rid, 0.0) + n * per_s
        cached = {rid: d(("cached", rid), v) for (rid,), v in values["unicache_router_cached_tokens_total"].items()}
        computed = {rid: d(("computed", rid), v) for (rid,), v in values["unicache_router_computed_tokens_total"].items()}
        buckets: dict[str, dict[float, float]] = {}
        for (rid, le), v in values["unicache_router_replica_ttft_seconds_bucket"].items():
            buckets.setdefault(rid, {})[float(le)] = d(("ttft", rid, le), v)
        replicas: dict[str, dict[str, Any]] = {}
        for rid in sorted(self.cluster.replicas):
            rec = self.cluster.replicas[rid]
            c, m = cached.get(rid, 0.0), computed.get(rid, 0.0)
            point: dict[str, Any] = {
                "healthy": self.cluster.healthy(rid),
                "hit_ratio": c / (c + m) if c + m > 0 else None,
                "requests_per_s": requests.get(rid, 0.0),
                "ttft_p50": None,
                "ttft_p99": None,
            }
            if rid in buckets:
                bounds = sorted(buckets[rid])
                cumulative = [buckets[rid][b] for b in bounds]
                counts = [cumulative[0]] + [cumulative[i] - cumulative[i - 1] for i in range(1, len(cumulative))]
                point["ttft_p50"] = bucket_quantile(0.5, bounds, counts)
                point["ttft_p99"] = bucket_quantile(0.99, bounds, counts)
            hb = rec.heartbeat
            cache = hb.cache if hb is not None else None
            for name in ("used_blocks", "cached_blocks", "free_blocks", "capacity_blocks"):
                point[name] = getattr(cache, name) if cache is not None else None
            point["queue_sizes"] = dict(cache.queue_sizes) if cache is not None else {}
            replicas[rid] = point
        entry = {"t": now, "replicas": replicas, "reasons": reasons}
        self.points.append(entry)
        return entry

    def to_json(self) -> dict[str, Any]:
        """What ``/dashboard/history`` answers: the settings and every point, oldest first."""
        return {"interval_s": self.interval_s, "capacity": self.capacity, "points": list(self.points)}

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad sample must not end the history
                log.exception("dashboard history sample failed")
            await asyncio.sleep(self.interval_s)
