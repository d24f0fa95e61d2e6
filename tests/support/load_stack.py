"""A whole serving stack in one process for load and fuzz tests: N real replicas
(``AsyncEngine`` with a 1-layer hidden-64 seeded model, ``ReplicaServer`` on port 0) behind
a real ``RouterApp`` (gRPC and HTTP on port 0, static replicas, no Redis).

Each replica's servicer records the request ids it was asked to generate, so a test can
prove that no request was lost or executed twice. ``freeze()`` holds every engine's lock,
which stops the step threads before their next step (requests then stay queued) while the
event loop keeps serving: overload tests use it to get exact, timing-free counts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import grpc

from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.replica.serving.server import ReplicaServer, ReplicaServicer
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.v1 import router_pb2_grpc

FAST_MODEL = dict(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=512)
API_KEYS = {"key-acme": "acme", "key-beta": "beta"}


class CountingServicer(ReplicaServicer):
    """``ReplicaServicer`` that records every request's id (in call order), on either transport."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.request_ids: list[str] = []

    async def outputs(self, request):
        self.request_ids.append(request.request_id)
        async with contextlib.aclosing(super().outputs(request)) as outputs:
            async for msg in outputs:
                yield msg


@dataclass
class InProcessReplica:
    replica_id: str
    engine: AsyncEngine
    server: ReplicaServer
    servicer: CountingServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


def fast_engine_config(**overrides) -> EngineConfig:
    """The fast test engine: 1 layer, hidden 64, CPU, LRU, one torch thread."""
    kw = dict(
        model=ModelConfig(**FAST_MODEL),
        num_blocks=1024,
        block_size=16,
        eviction_policy="lru",
        device="cpu",
        cpu_threads=1,
        max_num_seqs=128,
        max_num_batched_tokens=8192,
    )
    kw.update(overrides)
    return EngineConfig(**kw)


async def start_replica(replica_id: str, **engine_overrides) -> InProcessReplica:
    engine = AsyncEngine(fast_engine_config(**engine_overrides))
    await engine.start()
    server = ReplicaServer(engine, replica_id)
    servicer = CountingServicer(engine, replica_id)
    server.servicer = servicer  # NOTE: start() registers server.servicer
    await server.start()
    return InProcessReplica(replica_id, engine, server, servicer)


@dataclass
class LoadStack:
    """Replicas + router; build with ``await LoadStack.start(...)``, end with ``close()``."""

    replicas: list[InProcessReplica]
    app: RouterApp
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub
    _frozen: list = field(default_factory=list)

    @classmethod
    async def start(cls, num_replicas: int = 4, router: dict | None = None, **engine_overrides) -> "LoadStack":
        """Start ``num_replicas`` replicas and a router (round robin, auth on with
        ``API_KEYS``) over them. ``router`` overrides RouterConfig fields."""
        replicas = [await start_replica(f"r{i}", **engine_overrides) for i in range(num_replicas)]
        overrides = {
            "grpc_port": 0,
            "http_port": 0,
            "use_redis": False,
            "routing_policy": "round_robin",
            "block_size": replicas[0].engine.block_size,
            "api_keys": ",".join(f"{k}:{t}" for k, t in API_KEYS.items()),
            "salt_secret": "load-test-secret",
            "replicas": ",".join(f"{r.replica_id}={r.address}" for r in replicas),
            # NOTE: router and replicas share one event loop here, so an engine step that
            # holds the loop makes every replica look silent: no first-token stall
            # detection below the ceiling (tests/test_fault_* cover it on real processes).
            "first_token_timeout_floor_s": 60.0,
        }
        overrides.update(router or {})
        app = RouterApp(build_config(env={}, overrides=overrides))
        await app.start()
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{app.grpc_port}",
            options=[("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)],
        )
        return cls(replicas, app, channel, router_pb2_grpc.RouterStub(channel))

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    def referenced_blocks(self) -> list[int]:
        return [r.engine.num_referenced_blocks() for r in self.replicas]

    def served_ids(self) -> list[str]:
        return [rid for r in self.replicas for rid in r.servicer.request_ids]

    def freeze(self) -> None:
        """Stop every engine before its next step (hold its lock) until ``thaw()``."""
        for r in self.replicas:
            lock = r.engine.engine.lock
            lock.acquire()
            self._frozen.append(lock)

    def thaw(self) -> None:
        while self._frozen:
            self._frozen.pop().release()

    async def close(self) -> None:
        self.thaw()
        await self.channel.close()
        await self.app.stop(grace_s=0.5)
        for r in self.replicas:
            with contextlib.suppress(Exception):
                await r.server.stop()
            await r.engine.stop()
