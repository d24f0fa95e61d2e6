"""vLLM's probe and model card on the router's HTTP door: ``GET /health`` (200 when a
request can be routed, 503 when not) and ``/v1/models`` reporting ``max_model_len``, the
smallest context the replicas announce in their heartbeats (replica/publishing/publisher.py)."""

from __future__ import annotations

import pytest

from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import KVStore
from unicache.replica.publishing.publisher import CachePublisher
from unicache.testing.signed_state import SIGNER
from unicache.testing.store_source import StoreCacheSource
from unicache.v1 import cache_pb2

from tests.support.engine_factory import tiny_config
from tests.support.router_stack import config, single_replica_router


@pytest.fixture
async def single():
    async with single_replica_router() as stack:
        yield stack


async def test_health_is_200_while_routable_and_503_without_a_replica(single):
    app, rep, client = single
    r = await client.get("/health")
    assert (r.status_code, r.content) == (200, b"")
    app.cluster.remove("solo")
    r = await client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "service_unavailable"
    assert (await client.get("/readyz")).status_code == 503
    assert (await client.get("/healthz")).status_code == 200  # liveness: the process still serves


async def test_models_reports_the_smallest_max_model_len_the_replicas_announce(single):
    app, rep, client = single
    keyed = {"x-api-key": "key-a"}
    card = (await client.get("/v1/models", headers=keyed)).json()["data"][0]
    assert card == {"id": "unicache-default", "object": "model", "created": 0, "owned_by": "unicache",
                    "root": "unicache-default", "parent": None, "max_model_len": None}  # static: no heartbeat
    app.cluster.upsert("solo", rep.address, heartbeat=cache_pb2.Heartbeat(replica_id="solo", max_model_len=4096))
    app.cluster.upsert("big", "127.0.0.1:1", heartbeat=cache_pb2.Heartbeat(replica_id="big", max_model_len=32768))
    assert (await client.get("/v1/models", headers=keyed)).json()["data"][0]["max_model_len"] == 4096
    assert (await client.get("/v1/models/unicache-default", headers=keyed)).json()["max_model_len"] == 4096


def test_heartbeat_carries_the_engines_max_model_len():
    src = StoreCacheSource(KVStore(6, 4, make_policy("lru")), device="cpu")
    pub = CachePublisher(src, "r0", "redis://127.0.0.1:1/0", "127.0.0.1:5000", signer=SIGNER)
    assert pub.heartbeat().max_model_len == 0  # a source without a context: "unknown"
    src.max_model_len = 2048
    assert pub.heartbeat().max_model_len == 2048


async def test_the_built_in_engine_reports_its_context():
    eng = AsyncEngine(tiny_config(max_model_len=96))
    assert eng.max_model_len == 0  # before start: unknown
    await eng.start()
    try:
        assert eng.max_model_len == 96
    finally:
        await eng.stop()
