"""The router's view of its replicas: addresses, last heartbeats, in-flight counts.

Written by the Redis subscriber (or from static config) and read by the service; no I/O.

Invariants:
    * Every membership change goes through ``upsert``/``remove``, which notify the
      routing policy (``update_replicas``, ``on_replica_died``) and drop the replica's
      locality-index entry, so policy, index and membership never disagree for long.
    * ``in_flight[r]`` counts requests this router forwarded to r and not yet finished;
      it never goes negative.
    * A replica that answered UNAVAILABLE, or missed the forward deadline before its
      first message, is skipped for ``down_cooldown_s`` (not until its next heartbeat:
      during a Redis outage there are none), then tried again, or at once when its
      heartbeat announces a new address (it restarted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from unicache.router.index import LocalityIndex
from unicache.router.routing.base import LocalityView, ReplicaLoad, RoutingPolicy
from unicache.v1 import cache_pb2


@dataclass(slots=True)
class ReplicaRecord:
    replica_id: str
    address: str
    heartbeat: cache_pb2.Heartbeat | None = None
    down_until: float = 0.0  # clock time before which routing skips it (after UNAVAILABLE)
    static: bool = False
    in_flight: int = 0
    routed: int = 0


class EmptyView(LocalityView):
    """An index that knows nothing: what policies see while Redis is unreachable."""

    def match(self, replica_id: str, block_hashes) -> int:  # noqa: ARG002
        return 0

    def is_stale(self, replica_id: str) -> bool:  # noqa: ARG002
        # NOTE: it vouches for nothing, so policies fall back on their own memory
        # (cache_aware's session stickiness) instead of treating every replica as cold.
        return True


class ClusterView:
    """Live replicas plus the locality index, shared by subscriber and service.

    Args:
        policy: the routing policy to keep informed of membership changes.
        index: the locality index (one per router).
        on_change: optional callback after membership changes (metrics).
        down_cooldown_s: how long a replica that answered UNAVAILABLE is skipped (2 s).
        clock: monotonic clock.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        index: LocalityIndex,
        on_change: Callable[[], None] | None = None,
        down_cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy = policy
        self.index = index
        self.down_cooldown_s = down_cooldown_s
        self.clock = clock
        self.replicas: dict[str, ReplicaRecord] = {}
        self.redis_connected = False
        self._on_change = on_change
        self._empty = EmptyView()

    # --- membership -------------------------------------------------------------------
    def upsert(self, replica_id: str, address: str, heartbeat: cache_pb2.Heartbeat | None = None, static: bool = False) -> bool:
        """Add or refresh a replica. Returns True when it is new."""
        rec = self.replicas.get(replica_id)
        new = rec is None
        if new:
            rec = self.replicas[replica_id] = ReplicaRecord(replica_id, address, static=static)
        if address and address != rec.address:
            # NOTE: a new address is a new process (a restarted replica): the skip earned
            # by the old one's refusals does not apply to it.
            rec.address, rec.down_until = address, 0.0
        if heartbeat is not None:
            rec.heartbeat = heartbeat
        if new:
            self.policy.update_replicas(sorted(self.replicas))
            if self._on_change:
                self._on_change()
        return new

    def remove(self, replica_id: str) -> None:
        """The replica died (heartbeat expired): forget it everywhere."""
        if self.replicas.pop(replica_id, None) is None:
            return
        self.index.drop_replica(replica_id)
        self.policy.on_replica_died(replica_id)
        self.policy.update_replicas(sorted(self.replicas))
        if self._on_change:
            self._on_change()

    # --- what the service reads -------------------------------------------------------
    def locality(self) -> LocalityView:
        """The index, or an empty view when Redis is unreachable (session + load routing)."""
        return self.index if self.redis_connected else self._empty

    def loads(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[ReplicaLoad]:
        out = []
        for rid in sorted(self.replicas):
            if rid in exclude:
                continue
            rec = self.replicas[rid]
            if not self.healthy(rid):
                continue
            hb = rec.heartbeat
            if hb is not None:
                out.append(
                    ReplicaLoad(
                        rid,
                        running=hb.running,
                        waiting=hb.waiting,
                        queued_prefill_tokens=hb.queued_prefill_tokens,
                        free_blocks=hb.cache.free_blocks,
                        capacity_blocks=hb.cache.capacity_blocks,
                        in_flight=rec.in_flight,
                    )
                )
            else:
                out.append(ReplicaLoad(rid, in_flight=rec.in_flight))
        return out

    def healthy(self, replica_id: str) -> bool:
        rec = self.replicas.get(replica_id)
        return rec is not None and self.clock() >= rec.down_until

    def mark_down(self, replica_id: str) -> None:
        """The replica refused a call (UNAVAILABLE) or timed out before answering: skip it
        for ``down_cooldown_s``."""
        rec = self.replicas.get(replica_id)
        if rec is not None:
            rec.down_until = self.clock() + self.down_cooldown_s

    def started(self, replica_id: str) -> None:
        rec = self.replicas.get(replica_id)
        if rec is not None:
            rec.in_flight += 1
            rec.routed += 1

    def finished(self, replica_id: str) -> None:
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.in_flight > 0:
            rec.in_flight -= 1

    def total_in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas.values())
