"""A replica's Prometheus endpoint: a whole replica (``ReplicaRuntime``: engine, gRPC on
port 0, metrics on port 0, publisher) against a private redis-server and a real router.

A known workload (one prompt twice, then prompts that force evictions) is sent over gRPC;
the endpoint is scraped over HTTP and parsed with prometheus_client's own parser, and the
counts must be exactly what the workload implies. The metrics URL must reach the router's
cluster state through the replica's signed heartbeat.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from unicache.contract.redis_keys import RedisKeys
from unicache.replica.publishing.metrics_server import MetricsServer
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, call_metadata
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc

BS = 8
KEYS = RedisKeys("met")
MODEL = "metrics-model"


async def generate(address: str, ids: list[int], max_tokens: int) -> tuple[list[int], replica_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = replica_pb2_grpc.ReplicaStub(ch)
        req = replica_pb2.GenerateRequest(
            token_ids=replica_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, stop_token_ids=[]),
        )
        msgs = [m async for m in stub.Generate(req, timeout=60, metadata=call_metadata())]
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of every sample in the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name: str, **labels: str) -> tuple[str, tuple]:
    return name, tuple(sorted({"model_name": MODEL, **labels}.items()))


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


@pytest.fixture
async def replica(redis_server):
    settings = ReplicaSettings(
        replica_id="met-0", redis_url=redis_server.url, redis_prefix=KEYS.prefix, block_size=BS, num_blocks=8,
        eviction_policy="unicache", device="cpu", cluster_key=CLUSTER_KEY, insecure_no_tls=True, model_preset="tiny",
        served_model_name=MODEL,
    )
    runtime = ReplicaRuntime(settings)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


async def test_replica_metrics_count_a_known_workload_exactly(replica):
    url = replica.metrics_url
    assert url == f"http://127.0.0.1:{replica.metrics_server.port}/metrics"
    p1 = list(range(1, 21))  # 20 tokens: 2 full blocks + 4
    toks_a, last_a = await generate(replica.address, p1, max_tokens=3)
    toks_b, last_b = await generate(replica.address, p1, max_tokens=3)
    assert (len(toks_a), len(toks_b)) == (3, 3)
    assert (last_a.usage.cached_tokens, last_b.usage.cached_tokens) == (0, 16)  # the 2 full blocks hit

    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(url)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    got = samples(resp.text)
    assert got[key("vllm:prompt_tokens_total")] == 40
    assert got[key("vllm:prefix_cache_queries_total")] == 40
    assert got[key("vllm:prefix_cache_hits_total")] == 16
    assert got[key("vllm:generation_tokens_total")] == 6
    assert got[key("vllm:request_success_total", finished_reason="length")] == 2
    assert got[key("vllm:time_to_first_token_seconds_count")] == 2
    assert got[key("vllm:inter_token_latency_seconds_count")] == 4  # 2 requests x (3 - 1) gaps
    assert got[key("vllm:e2e_request_latency_seconds_count")] == 2
    assert got[key("vllm:num_requests_running")] == 0
    assert got[key("vllm:num_requests_waiting")] == 0
    assert got[key("vllm:kv_cache_usage_perc")] == 0.0  # nothing held between requests
    # 20 prompt + 2 fed-back tokens = 2 full blocks cached, twice released to evict_first.
    assert got[key("unicache_replica_blocks", state="cached")] == 2
    assert got[key("unicache_replica_blocks", state="free")] == 8
    assert got[key("unicache_replica_capacity_blocks")] == 8
    assert got[key("unicache_replica_queue_hits_total", queue="evict_first")] == 2
    assert got[key("unicache_replica_queue_evictions_total", queue="evict_first")] == 0
    assert got[key("unicache_replica_queue_blocks", queue="evict_first")] == 2
    assert got[key("unicache_replica_info", engine="torch", eviction_policy="unicache", replica="met-0")] == 1
    types = families(resp.text)
    assert (types["vllm:time_to_first_token_seconds"], types["vllm:prompt_tokens"], types["vllm:num_requests_running"]) == (
        "histogram", "counter", "gauge",
    )

    # A prompt of 7 full blocks (+1 token) needs 8 blocks: both cached blocks are evicted.
    p2 = list(range(100, 157))
    toks_c, last_c = await generate(replica.address, p2, max_tokens=1)
    assert (len(toks_c), last_c.usage.cached_tokens) == (1, 0)
    async with httpx.AsyncClient(timeout=10) as client:
        got = samples((await client.get(url)).text)
    assert got[key("unicache_replica_queue_evictions_total", queue="evict_first")] == 2
    assert got[key("vllm:prompt_tokens_total")] == 97
    assert got[key("vllm:prefix_cache_hits_total")] == 16
    assert got[key("vllm:inter_token_latency_seconds_count")] == 4  # one token: no gap


async def test_metrics_url_reaches_the_routers_cluster_state(replica, redis_server):
    cfg = build_config(
        env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1", "UNICACHE_API_KEYS": "k:t", "UNICACHE_SALT_SECRET": "s"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": KEYS.prefix, "block_size": BS},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05})
    await app.start()
    try:
        await eventually(lambda: "met-0" in app.cluster.replicas and app.cluster.replicas["met-0"].heartbeat is not None, "heartbeat")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            state = await stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=10)
            listed = await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)
        assert [r.info.metrics_url for r in state.replicas] == [replica.metrics_url]
        assert [r.metrics_url for r in listed.replicas] == [replica.metrics_url]
    finally:
        await app.stop()


async def test_metrics_server_answers_only_get_metrics():
    from prometheus_client import CollectorRegistry, Counter

    reg = CollectorRegistry()
    Counter("probe", "a probe", registry=reg).inc(3)
    server = MetricsServer([reg])
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            ok = await client.get("/metrics?x=1")
            missing = await client.get("/")
            post = await client.post("/metrics")
        assert (ok.status_code, samples(ok.text)[("probe_total", ())]) == (200, 3.0)
        assert (missing.status_code, post.status_code) == (404, 405)
    finally:
        await server.stop()


def test_a_negative_metrics_port_other_than_minus_one_is_refused():
    from unicache.plumbing.errors import UsageError

    with pytest.raises(UsageError, match="metrics_port must be -1"):
        ReplicaSettings(metrics_port=-2).check()


async def test_host_tier_series_follow_demotions_and_promotions(redis_server):
    """8 pool blocks over 16 host blocks: a prompt that fills the pool demotes the first
    prompt's 2 cached blocks; repeating the first prompt promotes them back."""
    rt = ReplicaRuntime(ReplicaSettings(
        replica_id="met-h", block_size=BS, num_blocks=8, host_blocks=16, eviction_policy="lru", device="cpu",
        model_preset="tiny", served_model_name=MODEL,
    ))
    await rt.start()
    try:
        p1 = list(range(1, 21))
        await generate(rt.address, p1, max_tokens=1)
        await generate(rt.address, list(range(100, 157)), max_tokens=1)  # 8 blocks: evicts p1's 2
        _, last = await generate(rt.address, p1, max_tokens=1)
        async with httpx.AsyncClient(timeout=10) as client:
            got = samples((await client.get(rt.metrics_url)).text)
    finally:
        await rt.stop()
    assert last.usage.cached_tokens == 16  # served from the host tier
    assert got[key("unicache_replica_host_capacity_blocks")] == 16
    assert got[key("unicache_replica_host_promotions_total")] == 2
    # p1's 2 blocks, then 2 of p2's 7 cached blocks for p1's 3 (its partial block takes the one uncached free block).
    assert got[key("unicache_replica_host_demotions_total")] == 4
    assert got[key("unicache_replica_host_evictions_total")] == 0


async def test_replicas_sharing_a_port_span_each_bind_the_next_free_port():
    import socket

    from prometheus_client import CollectorRegistry

    def free_pair() -> int:
        """A port p with p and p + 1 both free just now (an ephemeral port's neighbour may be
        taken by another socket of this process: check both, as the servers will need them)."""
        for _ in range(50):
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", 0))
                p = a.getsockname()[1]
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
        raise RuntimeError("no two consecutive free loopback ports")

    base = free_pair()
    servers = [MetricsServer([CollectorRegistry()], port=base, port_span=2) for _ in range(3)]
    try:
        assert [await s.start() for s in servers[:2]] == [base, base + 1]
        with pytest.raises(OSError):
            await servers[2].start()  # the span is used up
    finally:
        for s in servers:
            await s.stop()


async def test_refused_callers_and_hop_connections_are_exported(replica):
    """Callers without the cluster key are counted per transport; the hop's connections
    and streams as the replica sees them."""
    from unicache.contract import hop
    from unicache.router.upstream.hop_client import HopClient
    from unicache.contract.state_auth import parse_cluster_key

    async with grpc.aio.insecure_channel(replica.address) as ch:
        req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=[1, 2, 3]),
                                          sampling=common_pb2.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=10)]  # no credential
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    forger = HopClient(replica.hop_address, "met-0", hop.HopAuth(bytes(32)))  # a wrong key
    good = HopClient(replica.hop_address, "met-0", hop.HopAuth(parse_cluster_key(CLUSTER_KEY)))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await forger.stream(req, 10).first()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(2):
            stream = good.stream(req, 10)
            assert (await stream.first()).token_ids and await stream.next() is None
            stream.close()
        await eventually(lambda: len(replica.server.hop.connections) == 1, "the forger's connection to close")
        async with httpx.AsyncClient(timeout=10) as client:
            got = samples((await client.get(replica.metrics_url)).text)
    finally:
        forger.close()
        good.close()
    assert got[key("unicache_replica_refused_calls_total", transport="grpc")] == 1
    assert got[key("unicache_replica_refused_calls_total", transport="hop")] == 1
    assert got[key("unicache_replica_hop_connections")] == 1
    assert got[key("unicache_replica_hop_streams_total")] == 2
