"""Options every grpc.aio server of this project sets.

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
