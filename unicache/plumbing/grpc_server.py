"""Options every grpc.aio server of this project sets, and the keepalive of the router's
channels to the replicas.

grpc core holds a call that has arrived but that the application has not picked up yet
as *pending*. Beyond ``grpc.server.max_pending_requests`` (core's default: 1000) it
cancels pending calls that have waited too long, and beyond the hard limit it refuses new
ones. A burst larger than that into one server therefore ended some streams CANCELLED
before the application saw them: 230 of 2,000 concurrent streams into one fake replica,
4 of 1,100, none of 1,000 (``tests/router/test_grpc_pending.py``).
The router admits up to ``max_in_flight`` requests and answers the rest with
RESOURCE_EXHAUSTED itself; a replica admits ``max_num_seqs + max_waiting``. Invariant: a
server's soft pending limit is at least what its application admits, so core never
cancels a call the application would have taken, and overload is answered by the
application's own limit with its own status.
"""

from __future__ import annotations

# Core's own default soft limit, the floor: a server that admits less keeps it.
CORE_DEFAULT_MAX_PENDING = 1000


def pending_call_options(admitted: int) -> list[tuple[str, int]]:
    """grpc server options that let ``admitted`` calls wait for the application (soft
    limit) and refuse beyond twice that (hard limit)."""
    if admitted < 0:
        raise ValueError(f"admitted must be >= 0, got {admitted}")
    soft = max(CORE_DEFAULT_MAX_PENDING, admitted)
    return [("grpc.server.max_pending_requests", soft), ("grpc.server.max_pending_requests_hard_limit", 2 * soft)]


# HTTP/2 keepalive between the router and a replica: while calls are open the router pings
# every KEEPALIVE_TIME_MS and drops the connection when a ping goes unanswered for
# KEEPALIVE_TIMEOUT_MS, so a replica that vanished without closing its sockets (a node
# lost, a partition) or stopped answering at all (a frozen process) fails its streams
# UNAVAILABLE within about their sum instead of holding them until their deadlines. The
# framed hop does the same with TCP keepalive (unicache/contract/hop.py).
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000


def keepalive_channel_options() -> list[tuple[str, int]]:
    """The router's channel options: ping while calls are open, however long they are silent."""
    # NOTE: grpc core 1.85 ends a connection on an unanswered ping after
    # ``grpc.http2.ping_timeout_ms`` (default 1 minute); ``keepalive_timeout_ms`` alone did not.
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS), ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0)]


def keepalive_server_options() -> list[tuple[str, int]]:
    """A replica server's options: accept those pings (core's defaults answer a ping more
    often than every 5 minutes without data with GOAWAY, which would end a long prefill)."""
    return [("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2), ("grpc.http2.max_ping_strikes", 0)]
