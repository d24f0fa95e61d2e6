"""The cluster as the router sees it: one snapshot shared by both front doors (gRPC
``ClusterState``, HTTP ``/v1/cluster/state``) and the dashboard."""

from __future__ import annotations

import asyncio

from unicache.router.request_path.core import RouterCore
from unicache.v1 import common_pb2, router_pb2

STATIC_STATE_DEADLINE_S = 1.0


def replica_info(cluster, rid: str, transport: str = "auto") -> router_pb2.ReplicaInfo:
    """What the router tells about replica ``rid`` (``ListReplicas`` and the cluster state):
    device and metrics URL come from its last verified heartbeat (empty for a static one);
    the hop address only where requests take it (``transport`` "auto")."""
    rec = cluster.replicas[rid]
    hb = rec.heartbeat
    if rec.kind == "vllm":  # a stock vLLM server: its own metrics page
        return router_pb2.ReplicaInfo(replica_id=rid, address=rec.address, healthy=cluster.healthy(rid), device="vllm",
                                      metrics_url=f"{rec.address}/metrics",
                                      kv_events_schema=cluster.backend_schema.get(rid, ""))
    return router_pb2.ReplicaInfo(
        replica_id=rid, address=rec.address, healthy=cluster.healthy(rid),
        device=hb.device if hb else "", metrics_url=hb.metrics_url if hb else "",
        hop_address=rec.hop_address if transport == "auto" else "",
    )


def backend_cache_state(cluster, rid: str) -> common_pb2.CacheState:
    """A vLLM backend's cache as its ``/metrics`` and events tell it (no call)."""
    load, stats = cluster.replicas[rid].load, cluster.backend_stats.get(rid, {})
    queries = stats.get("prefix_queries", 0.0)
    return common_pb2.CacheState(
        replica_id=rid, block_size=int(stats.get("block_size", 0)), capacity_blocks=load.capacity_blocks,
        free_blocks=load.free_blocks, used_blocks=max(0, load.capacity_blocks - load.free_blocks),
        cached_blocks=cluster.index.num_blocks(rid), hit_ratio=stats.get("prefix_hits", 0.0) / queries if queries else 0.0,
    )


async def cluster_state(core: RouterCore, policy_name: str) -> router_pb2.ClusterState:
    """The cluster as the router sees it (shared by gRPC, HTTP JSON and the dashboard).

    Replicas known from Redis report the cache state of their last heartbeat; vLLM
    backends what their ``/metrics`` and events say; static replicas (``--replicas``, no heartbeats) are asked with ``GetCacheState`` under a
    deadline (``STATIC_STATE_DEADLINE_S``), and show an empty state if they do not answer.
    """
    cluster = core.cluster
    static = [rid for rid, rec in sorted(cluster.replicas.items()) if rec.heartbeat is None and rec.static and rec.kind == "replica"]
    answers = await asyncio.gather(
        *(core.clients.cache_state(cluster.replicas[rid].address, STATIC_STATE_DEADLINE_S) for rid in static),
        return_exceptions=True,
    )
    fetched = {rid: a for rid, a in zip(static, answers) if isinstance(a, common_pb2.CacheState)}
    out = router_pb2.ClusterState(redis_connected=cluster.redis_connected, routing_policy=policy_name)
    costs = cluster.cost_model.snapshot()
    for rid in sorted(cluster.replicas):
        rec = cluster.replicas[rid]
        hb = rec.heartbeat
        state = router_pb2.ReplicaState(
            info=replica_info(cluster, rid, core.clients.transport),
            running=hb.running if hb else rec.load.running,
            waiting=hb.waiting if hb else rec.load.waiting,
            indexed_blocks=cluster.index.num_blocks(rid),
        )
        if rec.kind == "vllm":
            state.cache.CopyFrom(backend_cache_state(cluster, rid))
        elif hb is not None:
            state.cache.CopyFrom(hb.cache)
        else:
            state.cache.CopyFrom(fetched.get(rid, common_pb2.CacheState(replica_id=rid)))
        if rid in costs:
            state.costs.CopyFrom(router_pb2.BackendCosts(**costs[rid]))
        out.replicas.append(state)
    return out
