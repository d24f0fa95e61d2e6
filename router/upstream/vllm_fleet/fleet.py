"""The router's vLLM backends as a set that may change: the listed ones (``backends``) plus
those ``backend_discovery`` finds, each followed by its own ``BackendFollower``.

``backend_discovery`` is either
``dns://NAME:HTTP_PORT?kv-events=PORT&replay=PORT&interval=S``: every ``interval`` seconds
(default 5) the name is resolved (a Kubernetes headless Service lists its ready pods'
addresses); each address is a backend ``vllm-<ip>-<port>`` at ``http://ip:HTTP_PORT`` with
its events at ``tcp://ip:PORT``; or ``k8s://NAMESPACE?selector=...``: the ready endpoints of
the EndpointSlices a label selector picks, watched through the Kubernetes API
(``unicache.router.upstream.vllm_fleet.k8s_discovery``).

Invariants:
    * One follower per backend id; a backend that leaves the discovered set is stopped and
      removed from the cluster (its index entries and policy state go with it), one that
      comes back (or comes back at another address) starts afresh.
    * Listed backends never leave; a failed resolution or API call changes nothing (DNS
      or API server hiccups do not empty the fleet).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

from unicache.plumbing.errors import UsageError
from unicache.router.cluster.view import ClusterView
from unicache.router.upstream.vllm_fleet.follower import BackendFollower
from unicache.router.upstream.vllm_fleet.http_stream import VllmClients
from unicache.router.upstream.vllm_fleet.k8s_discovery import K8sDiscovery
from unicache.router.upstream.vllm_fleet.spec import BackendSpec

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


class DnsDiscovery:
    """A parsed ``backend_discovery`` value (see the module docstring)."""

    def __init__(self, value: str):
        parts = urlsplit(value)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"kv-events", "replay", "interval"}
        if parts.scheme != "dns" or not parts.hostname or not parts.port or unknown:
            raise UsageError(
                f"backend_discovery {value!r}: expected dns://NAME:HTTP_PORT?kv-events=PORT[&replay=PORT][&interval=S]"
                + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else "")
            )
        try:
            self.events_port = int(query["kv-events"]) if "kv-events" in query else 0
            self.replay_port = int(query["replay"]) if "replay" in query else 0
            self.interval_s = float(query.get("interval", 5.0))
        except ValueError:
            raise UsageError(f"backend_discovery {value!r}: ports and interval must be numbers") from None
        if self.interval_s <= 0:
            raise UsageError(f"backend_discovery {value!r}: interval must be positive")
        self.name, self.http_port = parts.hostname, parts.port

    def spec(self, ip: str) -> BackendSpec:
        host = f"[{ip}]" if ":" in ip else ip
        return BackendSpec(
            f"vllm-{ip}-{self.http_port}", f"http://{host}:{self.http_port}",
            f"tcp://{host}:{self.events_port}" if self.events_port else "",
            f"tcp://{host}:{self.replay_port}" if self.replay_port else "",
        )


def parse_discovery(value: str) -> DnsDiscovery | K8sDiscovery:
    """A ``backend_discovery`` value by its scheme; UsageError naming what is wrong."""
    if value.startswith("k8s://"):
        return K8sDiscovery(value)
    return DnsDiscovery(value)


async def resolve_addresses(name: str, port: int) -> list[str]:
    """The addresses ``name`` resolves to (a headless Service: its ready pods)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class VllmFleet:
    """The followers of every vLLM backend (see the module docstring).

    Args:
        cluster, clients, block_size: as ``BackendFollower``'s.
        listed: the backends given by ``backends``.
        discovery: the ``backend_discovery`` setting ("": none).
        resolver: resolves a name to addresses (tests pass a fake).
        follower_kwargs: extra ``BackendFollower`` arguments (tests shorten intervals).
    """

    def __init__(
        self, cluster: ClusterView, clients: VllmClients, block_size: int, listed: list[BackendSpec],
        discovery: str = "", resolver: Resolver = resolve_addresses, follower_kwargs: dict | None = None,
    ):
        self.cluster = cluster
        self.clients = clients
        self.block_size = block_size
        self.discovery = parse_discovery(discovery) if discovery else None
        self.resolver = resolver
        self.follower_kwargs = follower_kwargs or {}
        self.listed = {spec.backend_id for spec in listed}
        self.followers: dict[str, BackendFollower] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._pending = list(listed)

    def __bool__(self) -> bool:
        return bool(self._pending or self.followers or self.discovery)

    async def run(self) -> None:
        for spec in self._pending:
            self._add(spec)
        self._pending = []
        try:
            if isinstance(self.discovery, K8sDiscovery):
                await self.discovery.follow(self.reconcile)
            while self.discovery is not None:
                await self.refresh()
                await asyncio.sleep(self.discovery.interval_s)
            await asyncio.Event().wait()
        finally:
            for rid in list(self._tasks):
                await self._stop(rid, remove=False)

    async def refresh(self) -> None:
        """Resolve the discovery name once and follow what it lists now."""
        d = self.discovery
        try:
            ips = await self.resolver(d.name, d.http_port)
        except OSError as exc:
            log.warning("backend discovery: cannot resolve %s (%s); keeping %d backends", d.name, exc, len(self.followers))
            return
        await self.reconcile({spec.backend_id: spec for spec in map(d.spec, ips)})

    async def reconcile(self, found: dict[str, BackendSpec]) -> None:
        """Follow exactly the listed backends and ``found`` (the discovered ones now)."""
        for rid in [r for r, f in self.followers.items() if r not in self.listed and found.get(r, f.spec) != f.spec]:
            log.info("backend discovery: %s moved to %s", rid, found[rid].url)
            await self._stop(rid, remove=True)
        for rid, spec in found.items():
            if rid not in self.followers:
                log.info("backend discovery: %s appeared (%s)", rid, spec.url)
                self._add(spec)
        for rid in [r for r in self.followers if r not in found and r not in self.listed]:
            log.info("backend discovery: %s is gone", rid)
            await self._stop(rid, remove=True)

    def _add(self, spec: BackendSpec) -> None:
        follower = BackendFollower(spec, self.cluster, self.clients, self.block_size, **self.follower_kwargs)
        self.followers[spec.backend_id] = follower
        self._tasks[spec.backend_id] = asyncio.create_task(follower.run(), name=f"router-backend-{spec.backend_id}")

    async def _stop(self, rid: str, remove: bool) -> None:
        follower, task = self.followers.pop(rid), self._tasks.pop(rid)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if remove:
            if follower.joined and follower.subscriber is not None:
                self.cluster.backend_events -= 1
            self.cluster.remove(rid)
            self.cluster.index.drop_replica(rid)
            self.cluster.backend_stats.pop(rid, None)
            self.cluster.backend_schema.pop(rid, None)
