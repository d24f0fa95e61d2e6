"""A whole UniCache cluster on loopback, for fault tests and ``bench/faults.py``.

Real processes: a private ``redis-server`` (the caller owns it: an ``EmbeddedRedis``),
Ray in-process (``ray.init`` bound to 127.0.0.1, a short private temp dir), N replica
actors through ``ReplicaLauncher`` with a tiny model, and a ``RouterApp`` in-process on
port 0 whose Redis subscriber polls fast. Nothing here is a fake: the faults act on
these processes (``redis.kill()``, ``ray.kill(actor)``, stopping the router).

Split in two because of the event loop: Ray and the replicas are synchronous and
long-lived (``start_ray`` + ``ReplicaSet``, once per test module), the router lives on
the test's event loop (``RouterHandle``, started and stopped inside an async test).

Invariants:
    * Every helper that waits has a deadline and names what it waited for on timeout.
    * ``RouterHandle.calls`` records every Generate the router forwards to a replica for
      a client ((monotonic time, replica address)), so tests can tell when it stopped
      dialling one; ``RouterHandle.probes`` records the quarantine probes the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from unicache.router.upstream.replica_client import PROBE_REQUEST_ID
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

API_KEY = "fault-key"
TENANT = "tenantF"

# Replica settings that start and answer fast: 2-layer hidden-64 model, LRU, 8-token
# blocks so short prompts span several blocks.
FAST_REPLICA = dict(
    model_preset="tiny",
    block_size=8,
    num_blocks=512,
    eviction_policy="lru",
    max_num_batched_tokens=1024,
    default_max_tokens=4,
)
# Router subscriber intervals for tests (production defaults: 1 s scans, 0.1-5 s backoff).
FAST_SUBSCRIBER = dict(
    heartbeat_interval_s=0.1,
    block_ms=20,
    resync_retry_s=0.1,
    backoff_initial_s=0.05,
    backoff_max_s=0.2,
)


def start_ray(num_cpus: int) -> str:
    """``ray.init`` in-process on loopback with a short private temp dir (AF_UNIX paths are
    capped at 107 bytes). Returns the temp dir; ``stop_ray`` removes it."""
    from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait

    prefer_passive_omp_wait()  # inherited by the replica workers
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    import ray

    tmp = tempfile.mkdtemp(prefix="ucf-", dir="/tmp")
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        _temp_dir=tmp,
    )
    return tmp


def stop_ray(tmp: str) -> None:
    import ray

    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


class ReplicaSet:
    """N replica actors (ids ``<id_prefix>-0..N-1``) publishing to one Redis.

    Args:
        redis_url: the replicas' Redis.
        prefix: Redis key prefix.
        num: replicas.
        id_prefix: replica id prefix.
        overrides: ``ReplicaSettings`` fields over ``FAST_REPLICA``.
    """

    def __init__(self, redis_url: str, prefix: str, num: int = 3, id_prefix: str = "f", **overrides: Any):
        from unicache.replica.launcher import ReplicaLauncher
        from unicache.replica.settings import ReplicaSettings

        settings = ReplicaSettings(
            redis_url=redis_url, redis_prefix=prefix, cluster_key=CLUSTER_KEY, insecure_no_tls=True,  # loopback test cluster
            **{**FAST_REPLICA, **overrides}
        )
        self.settings = settings
        self.launcher = ReplicaLauncher(settings, num, id_prefix=id_prefix, use_gpu=False, start_timeout_s=180)
        self.handles: dict[str, Any] = {}

    def start(self) -> list[str]:
        reps = self.launcher.start()
        self.handles = {r.replica_id: r.handle for r in reps}
        return sorted(self.handles)

    def stop(self) -> None:
        self.launcher.stop()

    @property
    def ids(self) -> list[str]:
        return sorted(self.handles)

    async def info(self, rid: str, timeout_s: float = 30.0) -> dict:
        """The actor's ``info()`` (address, epoch, pid); raises while it is down."""
        return await asyncio.wait_for(_ray_await(self.handles[rid].info.remote()), timeout_s)

    async def cached_hashes(self, rid: str, timeout_s: float = 30.0) -> set[bytes]:
        return set(await asyncio.wait_for(_ray_await(self.handles[rid].cached_hashes.remote()), timeout_s))

    async def set_faults(self, rid: str, first_token_delay_s: float = 0.0, token_delay_s: float = 0.0) -> None:
        ref = self.handles[rid].set_faults.remote(first_token_delay_s, token_delay_s)
        await asyncio.wait_for(_ray_await(ref), 30.0)

    def kill(self, rid: str) -> None:
        """Kill the actor's process; Ray restarts it (``max_restarts=-1``)."""
        import ray

        ray.kill(self.handles[rid], no_restart=False)


async def _ray_await(ref):
    return await ref


@dataclass(slots=True)
class Reply:
    """One client request's outcome through the router's gRPC API."""

    code: grpc.StatusCode
    details: str = ""
    replica: str = ""
    reason: str = ""
    matched_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    messages: int = 0

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


class RouterHandle:
    """A ``RouterApp`` on port 0 (gRPC + HTTP) following the cluster's Redis, plus a client.

    Args:
        redis_url / prefix: where the replicas publish.
        block_size: must equal the replicas'.
        subscriber_kwargs: ``RedisSubscriber`` tunables (default ``FAST_SUBSCRIBER``;
            pass ``{}`` for production defaults).
        policy_factory: builds the routing policy at each ``start`` (default: the
            config's ``routing_policy``).
        **config: ``RouterConfig`` fields (e.g. ``forward_deadline_s``).
    """

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        block_size: int,
        subscriber_kwargs: dict | None = None,
        policy_factory: Callable[[], Any] | None = None,
        **config: Any,
    ):
        from unicache.router.config import build_config

        self.cfg = build_config(
            env={"UNICACHE_API_KEYS": f"{API_KEY}:{TENANT}", "UNICACHE_SALT_SECRET": "fault-salt", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY,
                 "UNICACHE_INSECURE_NO_TLS": "1"},
            overrides={
                "grpc_port": 0,
                "http_port": 0,
                "redis_url": redis_url,
                "redis_prefix": prefix,
                "block_size": block_size,
                "tokenizer": "byte",
                **config,
            },
        )
        self.subscriber_kwargs = FAST_SUBSCRIBER if subscriber_kwargs is None else subscriber_kwargs
        self.policy_factory = policy_factory
        self.app = None
        self.calls: list[tuple[float, str]] = []
        self.probes: list[tuple[float, str]] = []
        self.quarantines: list[tuple[float, str]] = []  # (monotonic time, replica id) of each quarantine
        self._channel: grpc.aio.Channel | None = None
        self.stub: router_pb2_grpc.RouterStub | None = None

    async def start(self) -> None:
        from unicache.router.app import RouterApp

        policy = self.policy_factory() if self.policy_factory else None
        self.app = RouterApp(self.cfg, policy=policy, subscriber_kwargs=dict(self.subscriber_kwargs))
        clients = self.app.clients
        original = clients.generate

        def spy(address, request, timeout_s=None, hop_address="", replica_id=""):
            log = self.probes if request.request_id == PROBE_REQUEST_ID else self.calls
            log.append((time.monotonic(), address))
            return original(address, request, timeout_s, hop_address, replica_id)

        clients.generate = spy  # type: ignore[method-assign]
        cluster = self.app.cluster
        quarantine = cluster.quarantine

        def counted(rid):
            new = quarantine(rid)
            if new:
                self.quarantines.append((time.monotonic(), rid))
            return new

        cluster.quarantine = counted  # type: ignore[method-assign]
        await self.app.start()
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.app.grpc_port}")
        self.stub = router_pb2_grpc.RouterStub(self._channel)

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.app is not None:
            await self.app.stop()
            self.app = None

    # ---------------------------------------------------------------- requests
    def call(self, text: str, max_tokens: int = 4, session_id: str = "", task: str = "", timeout_s: float = 60.0):
        """Start one streaming Generate (the raw call, for tests that read it step by step)."""
        req = router_pb2.RouterGenerateRequest(
            text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens), session_id=session_id, task=task
        )
        return self.stub.Generate(req, metadata=[("x-api-key", API_KEY)], timeout=timeout_s)

    async def generate(self, text: str, max_tokens: int = 4, session_id: str = "", task: str = "", timeout_s: float = 60.0) -> Reply:
        """Send one request and read it to the end; errors come back as the Reply's code."""
        call = self.call(text, max_tokens, session_id, task, timeout_s)
        reply = Reply(grpc.StatusCode.OK)
        try:
            async for msg in call:
                reply.messages += 1
                reply.tokens.extend(msg.token_ids)
                if msg.HasField("route"):
                    reply.replica, reply.reason = msg.route.replica_id, msg.route.reason
                    reply.matched_tokens = msg.route.matched_tokens
                if msg.HasField("usage"):
                    reply.prompt_tokens, reply.cached_tokens = msg.usage.prompt_tokens, msg.usage.cached_tokens
        except grpc.aio.AioRpcError as exc:
            reply.code, reply.details = exc.code(), exc.details() or ""
        return reply

    async def probe(self, rid: str, text: str, max_tokens: int = 4) -> Reply:
        """Send one request through the router while every other replica is quarantined
        (with no probe due), so it must go to ``rid``; the others are restored after."""
        cluster = self.cluster
        others = [r for r in cluster.replicas.values() if r.replica_id != rid]
        saved = [(r.quarantined, r.probe_at, r.probe_backoff_s) for r in others]
        for r in others:
            cluster.quarantine(r.replica_id)  # out of routing (one already out keeps its schedule)
            r.probe_at = float("inf")  # and no probe brings it back meanwhile
        try:
            return await self.generate(text, max_tokens)
        finally:
            for r, (quarantined, probe_at, backoff) in zip(others, saved):
                if not quarantined:
                    cluster.probe_succeeded(r.replica_id)
                r.probe_at, r.probe_backoff_s = probe_at, backoff

    # ---------------------------------------------------------------- state
    @property
    def cluster(self):
        return self.app.cluster

    def indexed(self, rid: str) -> set[bytes]:
        index = self.app.index
        return set(index.holdings(rid).blocks) if rid in index.replicas() else set()

    def in_sync(self, rid: str, epoch: int | None = None) -> bool:
        """The index follows ``rid`` (summary applied, no gap) at ``epoch`` if given."""
        index = self.app.index
        if rid not in self.cluster.replicas or index.needs_resync(rid) or not self.cluster.redis_connected:
            return False
        return epoch is None or index.holdings(rid).epoch == epoch

    def metrics_value(self, name: str, **labels: str) -> float | None:
        """A sample of the router's metrics registry (None if it has no such series)."""
        return self.app.metrics.registry.get_sample_value(name, labels)

    def calls_to(self, address: str, since: float = 0.0) -> list[float]:
        return [t for t, a in self.calls if a == address and t >= since]


def prompt_text(tag: str, n: int) -> str:
    """An ASCII prompt of exactly ``n`` bytes (= byte-tokenizer tokens); distinct tags
    differ from the first block on (a crc of the tag leads), so they share no prefix."""
    body = f"{zlib.crc32(tag.encode()):08x} [{tag}] " + " ".join(f"{tag}-{i}" for i in range(n))
    return body[:n]


def locality_first():
    """cache_aware without its churn term, for scenarios that need a request to land where
    its prefix is cached (the fault handling under test does not depend on the policy)."""
    from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy

    return CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0))


def prompt_hashes(router: "RouterHandle", prompt: str) -> list:
    from unicache.contract.block_hash import hash_token_blocks

    return hash_token_blocks(list(prompt.encode()), router.cfg.block_size, cache_salt=router.app.auth.cache_salt(TENANT))


async def wait_for(cond: Callable[[], Awaitable[bool] | bool], what: str, timeout_s: float = 30.0, every_s: float = 0.02) -> float:
    """Poll ``cond`` (sync or async) until true; returns the seconds it took."""
    t0 = time.monotonic()
    await eventually(cond, what, timeout_s, every_s)
    return time.monotonic() - t0


async def index_matches_caches(router: RouterHandle, replicas: ReplicaSet) -> bool:
    """Every replica's indexed block set equals its prefix cache right now (and it is in sync)."""
    for rid in replicas.ids:
        if not router.in_sync(rid):
            return False
        if router.indexed(rid) != await replicas.cached_hashes(rid):
            return False
    return True


async def epochs(replicas: ReplicaSet) -> dict[str, int]:
    return {rid: (await replicas.info(rid))["epoch"] for rid in replicas.ids}
