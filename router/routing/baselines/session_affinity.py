"""Session affinity: consistent hashing of (tenant, session id) onto a ring of replicas.

Every replica owns ``virtual_nodes`` points on a 64-bit ring (xxh64 of
``"<replica_id>#<i>"``); a session goes to the owner of the first point clockwise of the
session key's hash. Requests without a session go to the least loaded replica.

Invariants:
    * Deterministic across processes (xxh64 with seed 0, never ``hash()``), so two
      routers with the same replica set route a session to the same replica.
    * Stable under membership change: when a replica joins, only sessions whose key
      falls on its new points move (about 1/N of them); when a replica leaves or is
      not in the ``replicas`` passed to ``choose``, only its own sessions move, to the
      next live owner clockwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.router.routing.keys import HashRing, pick_least_loaded, session_key
from unicache.router.routing.registry import register_routing_policy


@register_routing_policy("session_affinity")
class SessionAffinityPolicy(RoutingPolicy):
    """Consistent hashing on the session; least loaded without one.

    Args:
        virtual_nodes: ring points per replica (default 160).
    """

    def __init__(self, virtual_nodes: int = 160):
        self.ring = HashRing(virtual_nodes)

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        self.ring.set_members(replica_ids)

    def on_replica_died(self, replica_id: str) -> None:
        self.ring.remove(replica_id)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        sid = request.cls.session_id
        if sid is None:
            chosen = pick_least_loaded(replicas)
            return RouteDecision(chosen.replica_id, "no_session_least_loaded")
        live = {r.replica_id for r in replicas}
        for r in live - self.ring.members:
            # A replica the router has not announced yet: join it now (stable for others).
            self.ring.add(r)
        owner = self.ring.owner(session_key(request.cls.tenant, sid), live)
        assert owner is not None  # live is non-empty and every live replica is a member
        return RouteDecision(owner, "session_hash")
