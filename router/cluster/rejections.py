"""Counting what the router drops from replica state (Redis payloads, summaries).

``unicache_router_state_rejected_total{reason}`` counts every drop; a warning line is
logged at most once per ``warn_interval_s`` per reason (a forger writing every millisecond
must not flood the log), naming the reason, the replica id as written (repr, truncated:
it is attacker-controlled text) and how many were dropped since the last line.

Reasons:
    bad_mac        unsigned, truncated, modified, or signed with another key
    wrong_replica  a valid payload stored under another replica's key
    unparsable     a valid MAC over bytes that are not the expected protobuf
    replay         an older heartbeat (epoch, seq), or a batch of an older epoch/seq
    stale          a heartbeat older than the allowed age, or one that stopped advancing
    identity       the peer at a heartbeat's address could not prove it is that replica
    over_capacity  more blocks claimed than the replica's capacity
    gap            an event batch that does not follow (resynced from the replica)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("unicache.router.state")

REASONS = ("bad_mac", "wrong_replica", "unparsable", "replay", "stale", "identity", "over_capacity", "gap")


class StateRejections:
    """Counts drops by reason (``counts`` for tests and benches, and a Prometheus counter).

    Args:
        registry: where the counter lives (the router's registry); None: no metric.
        warn_interval_s: at most one warning per reason this often (default 60 s).
        clock: monotonic clock.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        warn_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.warn_interval_s = warn_interval_s
        self.clock = clock
        self._last_warn: dict[str, float] = {}
        self._since_warn: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._counter = None
        if registry is not None:
            self._counter = Counter(
                "unicache_router_state_rejected", "Replica state the router dropped, by reason", ["reason"], registry=registry
            )
            for reason in REASONS:
                self._counter.labels(reason)  # every series exists from the start (at 0)

    def reject(self, reason: str, replica_id: str, what: str) -> None:
        if reason not in self.counts:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self.counts[reason] += 1
        self._since_warn[reason] += 1
        if self._counter is not None:
            self._counter.labels(reason).inc()
        now = self.clock()
        last = self._last_warn.get(reason)
        if last is None or now - last >= self.warn_interval_s:
            n, self._since_warn[reason] = self._since_warn[reason], 0
            self._last_warn[reason] = now
            log.warning(
                "dropped %s for replica %r: %s (%d dropped for this reason since the last such line)",
                what, replica_id[:64], reason, n,
            )

    def total(self) -> int:
        return sum(self.counts.values())
