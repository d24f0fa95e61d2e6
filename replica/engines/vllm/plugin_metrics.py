"""UniCache's own series from inside a stock vLLM server, on a port of its own.

vLLM's ``/metrics`` is served by its API-server process from the stats the engine core
sends it; the scheduler, which holds the policy, lives in the engine-core process and
cannot add series there. So ``additional_config["unicache"]["metrics_port"]`` makes the
scheduler serve the replica's ``unicache_replica_*`` cache series (``ReplicaCollector``:
blocks by state, capacity, queue sizes, evictions and hits by queue), named as a
replica's are, from the pool's latest snapshot, on that port.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from unicache.replica.engines.api import CacheStateInfo
from unicache.replica.engines.vllm.status import PoolStatus
from unicache.replica.publishing.metrics import ReplicaCollector


class _Snapshot:
    """The engine side ``ReplicaCollector`` reads: the scheduler's latest pool snapshot."""

    def __init__(self, latest: Callable[[], PoolStatus], block_size: int):
        self._latest = latest
        self._block_size = block_size

    def cache_state(self) -> CacheStateInfo:
        return self._latest().cache_state(self._block_size)


def serve_plugin_metrics(
    port: int, latest: Callable[[], PoolStatus], block_size: int, model_name: str, host: str = "0.0.0.0"
) -> CollectorRegistry:
    """Serve the series on ``host:port`` (a daemon thread); returns the registry."""
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(_Snapshot(latest, block_size), model_name, "", "vllm", load_gauges=False))
    start_http_server(port, addr=host, registry=registry)
    return registry
