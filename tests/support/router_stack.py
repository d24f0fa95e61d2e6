"""A router in front of in-process fake replicas (unicache/testing/fake_replica.py), as the
HTTP and gRPC door tests build it: static replicas, two API keys, no Redis."""

from __future__ import annotations

import contextlib

import httpx

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica

KEYS = "key-a:tenantA,key-b:tenantB"


def config(replicas: list[FakeReplica], **overrides):
    """Router config for ``replicas`` (round robin unless ``overrides`` say otherwise)."""
    spec = ",".join(f"{r.replica_id}={r.address}" for r in replicas)
    env = {"UNICACHE_API_KEYS": KEYS, "UNICACHE_SALT_SECRET": "s3cret", "UNICACHE_USE_REDIS": "false"}
    base = {"grpc_port": 0, "http_port": 0, "replicas": spec, "routing_policy": "round_robin"}
    base.update(overrides)
    return build_config(env=env, overrides=base)


@contextlib.asynccontextmanager
async def single_replica_router(**overrides):
    """(app, the replica "solo", an HTTP client of the router's door), all stopped after."""
    rep = FakeReplica("solo")
    await rep.start()
    app = RouterApp(config([rep], **overrides))
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        yield app, rep, client
    finally:
        await client.aclose()
        await app.stop()
        await rep.stop()
