"""One running replica: engine, gRPC server and cache publisher, started and stopped
together. The Ray actor and ``unicache replica`` both wrap this, so they behave alike.

Invariant: after ``start`` returns, the gRPC server answers health checks as SERVING and
(when a Redis URL is set) the publisher has tried its first summary; Redis being down
never makes ``start`` fail.
"""

from __future__ import annotations

import asyncio
import logging

from unicache.contract.redis_keys import RedisKeys
from unicache.plumbing.aio import cancel_and_wait
from unicache.plumbing.errors import UsageError
from unicache.replica.engines.api import ServingEngine
from unicache.replica.engines.registry import make_engine
from unicache.replica.publishing.metrics import ReplicaMetrics
from unicache.replica.publishing.metrics_server import MetricsServer
from unicache.replica.publishing.publisher import CachePublisher
from unicache.replica.serving.server import ReplicaServer
from unicache.replica.settings import ReplicaSettings

log = logging.getLogger(__name__)


def replica_metrics(engine: ServingEngine, s: ReplicaSettings) -> tuple[ReplicaMetrics, list]:
    """The replica's metrics and the registries its endpoint serves. The vLLM engine's own
    Prometheus logger writes vLLM's series to prometheus_client's global registry: served
    as they are, and ours then defines only the ``unicache_replica_*`` series."""
    own = s.engine == "vllm"
    metrics = ReplicaMetrics(engine, s.model_name(), s.replica_id, s.engine, request_series=not own)
    if not own:
        return metrics, [metrics.registry]
    from prometheus_client import REGISTRY

    return metrics, [metrics.registry, REGISTRY]


class ReplicaRuntime:
    def __init__(self, settings: ReplicaSettings):
        self.settings = settings
        self.engine: ServingEngine | None = None
        self.server: ReplicaServer | None = None
        self.publisher: CachePublisher | None = None
        self.metrics_server: MetricsServer | None = None
        self.address = ""
        self.hop_address = ""
        self._drain: asyncio.Task | None = None

    async def start(self) -> str:
        """Start everything; returns the advertised ``host:port``. On failure (a bad Redis
        setting, a port in use) stops what already started, then raises."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> str:
        s = self.settings
        key = s.resolved_cluster_key()
        if s.redis_url and key is None:
            raise UsageError(
                "a replica that publishes to Redis needs a cluster key (set UNICACHE_CLUSTER_KEY or cluster_key_file): "
                "routers trust only state signed with it"
            )
        insecure = s.check_transport()
        password = s.resolved_redis_password()
        self.engine = make_engine(s)
        await self.engine.start()
        metrics = None
        if s.metrics_port >= 0:
            metrics, registries = replica_metrics(self.engine, s)
            metrics.insecure_transport.set(1 if insecure else 0)
            self.metrics_server = MetricsServer(
                registries, s.host, s.metrics_port, advertise_host=s.advertised_host(), port_span=s.metrics_port_span
            )
            await self.metrics_server.start()
        self.server = ReplicaServer(
            self.engine, s.replica_id, s.host, s.port, s.default_max_tokens, faults=s.faults(), cluster_key=key,
            metrics=metrics, max_pending_calls=s.max_num_seqs + s.max_waiting,
            hop_port=s.hop_port if s.hop_port >= 0 else None, tls=s.tls_files(),
        )
        if metrics is not None:
            metrics.watch_transports(self.server)
        port = await self.server.start()
        host = s.advertised_host()
        self.address = f"{host}:{port}"
        self.hop_address = f"{host}:{self.server.hop_port}" if self.server.hop_port else ""
        if s.redis_url:
            self.publisher = CachePublisher(
                self.engine, s.replica_id, s.redis_url, self.address, RedisKeys(s.redis_prefix),
                password=password or None, tls_ca=s.redis_tls_ca or None, signer=self.server.signer,
                metrics_url=self.metrics_url, hop_address=self.hop_address,
            )
            self.server.servicer.summary_source = self.publisher.signed_summary
            await self.publisher.start()
        else:
            # Nobody publishes: still take the engine's cache events so they cannot pile up.
            self._drain = asyncio.create_task(self._drain_events())
        log.info("replica %s up at %s on %s", s.replica_id, self.address, self.engine.device)
        return self.address

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of this replica's Prometheus endpoint ("" when none)."""
        return self.metrics_server.url if self.metrics_server is not None else ""

    def info(self) -> dict:
        return {
            "replica_id": self.settings.replica_id,
            "address": self.address,
            "hop_address": self.hop_address,
            "metrics_url": self.metrics_url,
            "device": str(self.engine.device) if self.engine else "",
            "epoch": self.publisher.epoch if self.publisher else 0,
        }

    async def _drain_events(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.engine.take_events()

    async def stop(self) -> None:
        """Stop in reverse order: stop publishing (heartbeat deleted), drain gRPC, stop the engine."""
        if self._drain is not None:
            await cancel_and_wait([self._drain])
            self._drain = None
        if self.publisher is not None:
            await self.publisher.stop()
            self.publisher = None
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
