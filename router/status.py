"""``unicache status --router ADDR``: the router's cluster state as a terminal table.

Fetches ``GetClusterState`` over gRPC (with a deadline) and formats it; ``format_table``
is pure so tests check the exact text.
"""

from __future__ import annotations

import grpc

from unicache.errors import UsageError
from unicache.v1 import router_pb2, router_pb2_grpc

COLUMNS = ("replica", "address", "device", "health", "run", "wait", "capacity", "used", "free", "cached", "hit%", "evict", "indexed", "queues")


def fetch_cluster_state(address: str, timeout_s: float = 5.0) -> router_pb2.ClusterState:
    """GetClusterState from the router at ``address``; unreachable -> UsageError (one line)."""
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            return stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise UsageError(f"router {address} unreachable: {exc.code().name}") from None


def format_table(state: router_pb2.ClusterState) -> str:
    rows = [COLUMNS]
    for rs in state.replicas:
        c = rs.cache
        queues = " ".join(f"{k}={c.queue_sizes[k]}" for k in sorted(c.queue_sizes)) or "-"
        rows.append(
            (
                rs.info.replica_id,
                rs.info.address,
                rs.info.device or "-",
                "ok" if rs.info.healthy else "down",
                str(rs.running),
                str(rs.waiting),
                str(c.capacity_blocks),
                str(c.used_blocks),
                str(c.free_blocks),
                str(c.cached_blocks),
                f"{100 * c.hit_ratio:.1f}",
                str(c.evictions),
                str(rs.indexed_blocks),
                queues,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        f"routing policy: {state.routing_policy or '-'}   redis: {'connected' if state.redis_connected else 'DISCONNECTED'}   replicas: {len(state.replicas)}"
    ]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) if i in (0, 1, 2, 3, 13) else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)
