"""The cluster as the router sees it: one snapshot shared by both front doors (gRPC
``ClusterState``, HTTP ``/v1/cluster/state``) and the dashboard."""

from __future__ import annotations

import asyncio

from unicache.router.core import RouterCore
from unicache.v1 import common_pb2, router_pb2

STATIC_STATE_DEADLINE_S = 1.0


def replica_info(cluster, rid: str, transport: str = "auto") -> router_pb2.ReplicaInfo:
    """What the router tells about replica ``rid`` (``ListReplicas`` and the cluster state):
    device and metrics URL come from its last verified heartbeat (empty for a static one);
    the hop address only where requests take it (``transport`` "auto")."""
    rec = cluster.replicas[rid]
    hb = rec.heartbeat
    return router_pb2.ReplicaInfo(
        replica_id=rid, address=rec.address, healthy=cluster.healthy(rid),
        device=hb.device if hb else "", metrics_url=hb.metrics_url if hb else "",
        hop_address=rec.hop_address if transport == "auto" else "",
    )


async def cluster_state(core: RouterCore, policy_name: str) -> router_pb2.ClusterState:
    """The cluster as the router sees it (shared by gRPC, HTTP JSON and the dashboard).

    Replicas known from Redis report the cache state of their last heartbeat; static
    replicas (``--replicas``, no heartbeats) are asked with ``GetCacheState`` under a
    deadline (``STATIC_STATE_DEADLINE_S``), and show an empty state if they do not answer.
    """
    cluster = core.cluster
    static = [rid for rid, rec in sorted(cluster.replicas.items()) if rec.heartbeat is None and rec.static]
    answers = await asyncio.gather(
        *(core.clients.cache_state(cluster.replicas[rid].address, STATIC_STATE_DEADLINE_S) for rid in static),
        return_exceptions=True,
    )
    fetched = {rid: a for rid, a in zip(static, answers) if isinstance(a, common_pb2.CacheState)}
    out = router_pb2.ClusterState(redis_connected=cluster.redis_connected, routing_policy=policy_name)
    for rid in sorted(cluster.replicas):
        rec = cluster.replicas[rid]
        hb = rec.heartbeat
        state = router_pb2.ReplicaState(
            info=replica_info(cluster, rid, core.clients.transport),
            running=hb.running if hb else 0,
            waiting=hb.waiting if hb else 0,
            indexed_blocks=cluster.index.num_blocks(rid),
        )
        if hb is not None:
            state.cache.CopyFrom(hb.cache)
        else:
            state.cache.CopyFrom(fetched.get(rid, common_pb2.CacheState(replica_id=rid)))
        out.replicas.append(state)
    return out
