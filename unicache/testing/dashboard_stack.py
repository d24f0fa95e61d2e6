"""A small live cluster in one process for the dashboard test and its screenshot: a
private redis-server, N whole replicas (``ReplicaRuntime``: tiny seeded model, gRPC and
metrics on free ports, signed heartbeats) and a ``RouterApp`` following them through Redis.

The router's history does not sample by itself here (its period is an hour): callers call
``sample()``, so the number of points is theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY

PREFIX = "dash"
API_KEY = "dash-key"
BLOCK_SIZE = 8


@dataclass
class DashboardStack:
    redis: EmbeddedRedis
    replicas: list[ReplicaRuntime]
    app: RouterApp
    client: httpx.AsyncClient

    @classmethod
    async def start(cls, num_replicas: int = 2, routing_policy: str = "round_robin", num_blocks: int = 64,
                    eviction_policy: str = "unicache") -> "DashboardStack":
        redis = EmbeddedRedis()
        redis.start()
        replicas: list[ReplicaRuntime] = []
        app = None
        try:
            for i in range(num_replicas):
                rt = ReplicaRuntime(ReplicaSettings(
                    replica_id=f"replica-{i}", redis_url=redis.url, redis_prefix=PREFIX, block_size=BLOCK_SIZE,
                    num_blocks=num_blocks, eviction_policy=eviction_policy, device="cpu", cluster_key=CLUSTER_KEY,
                    insecure_no_tls=True, model_preset="tiny", default_max_tokens=4,
                ))
                replicas.append(rt)
                await rt.start()
            cfg = build_config(
                env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1", "UNICACHE_API_KEYS": f"{API_KEY}:tenant",
                     "UNICACHE_SALT_SECRET": "s"},
                overrides={
                    "grpc_port": 0, "http_port": 0, "redis_url": redis.url, "redis_prefix": PREFIX,
                    "block_size": BLOCK_SIZE, "routing_policy": routing_policy,
                },
            )
            app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05})
            app.history.interval_s = 3600.0
            await app.start()
            ids = sorted(r.settings.replica_id for r in replicas)
            await eventually(
                lambda: sorted(app.cluster.replicas) == ids and all(app.cluster.replicas[i].heartbeat is not None for i in ids),
                "replicas to join the router", timeout_s=60,
            )
        except BaseException:
            if app is not None:
                await app.stop()
            for rt in replicas:
                await rt.stop()
            redis.close()
            raise
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=60, headers={"x-api-key": API_KEY})
        return cls(redis, replicas, app, client)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    async def complete(self, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
        resp = await self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})
        resp.raise_for_status()
        return resp

    async def wait_heartbeats(self) -> None:
        """Until the router holds a heartbeat newer than every replica's last change (the
        publisher beats every second): the block figures then match the replicas'."""
        want = {r.settings.replica_id: r.engine.cache_state() for r in self.replicas}

        def fresh() -> bool:
            for rid, st in want.items():
                hb = self.app.cluster.replicas[rid].heartbeat
                if hb is None or (hb.cache.used_blocks, hb.cache.cached_blocks) != (st.used_blocks, st.cached_blocks):
                    return False
            return True

        await eventually(fresh, "fresh heartbeats", timeout_s=30)

    def sample(self) -> dict:
        return self.app.history.sample()

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.stop()
        for rt in self.replicas:
            await rt.stop()
        self.redis.close()
