"""``unicache status --router ADDR``: the router's cluster state as a terminal table.

Fetches ``GetClusterState`` over gRPC (with a deadline) and formats it; ``format_table``
is pure so tests check the exact text. A router with an admin key wants it presented:
``admin_key_from_env`` reads ``UNICACHE_ADMIN_KEY`` or the file ``UNICACHE_ADMIN_KEY_FILE``
(never a flag: a flag is visible in /proc/<pid>/cmdline).
"""

from __future__ import annotations

import os

import grpc

from unicache.plumbing.errors import UsageError
from unicache.plumbing.settings import env_name, resolve_secret
from unicache.v1 import router_pb2, router_pb2_grpc

COLUMNS = ("replica", "address", "hop", "device", "health", "run", "wait", "capacity", "used", "free", "cached", "hit%", "evict", "host", "indexed", "queues")


def host_cell(c) -> str:
    """The host tier of a ``CacheState``: used/capacity, hit %, promotions (p) and
    demotions (d); "-" without one."""
    if not c.HasField("host"):
        return "-"
    h = c.host
    return f"{h.used_blocks}/{h.capacity_blocks} {100 * h.hit_ratio:.1f}% p{h.promotions} d{h.demotions}"


def admin_key_from_env() -> str:
    """The admin key from ``UNICACHE_ADMIN_KEY`` or the file ``UNICACHE_ADMIN_KEY_FILE``;
    "" when neither is set."""
    name = "admin_key"
    return resolve_secret(os.environ.get(env_name(name), ""), os.environ.get(env_name(name + "_file"), ""), name)


def fetch_cluster_state(address: str, timeout_s: float = 5.0, admin_key: str = "") -> router_pb2.ClusterState:
    """GetClusterState from the router at ``address``, presenting ``admin_key`` when given.

    Unreachable, or refused for want of the admin key -> UsageError (one line)."""
    metadata = (("authorization", f"Bearer {admin_key}"),) if admin_key else None
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            return stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise UsageError(
                    f"router {address} wants its admin key: set {env_name('admin_key')} or {env_name('admin_key_file')}"
                ) from None
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
                rs.info.hop_address or "-",
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
                host_cell(c),
                str(rs.indexed_blocks),
                queues,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        f"routing policy: {state.routing_policy or '-'}   redis: {'connected' if state.redis_connected else 'DISCONNECTED'}   replicas: {len(state.replicas)}"
    ]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) if i in (0, 1, 2, 3, 12, 14) else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)
