"""Round robin: the baseline that ignores both locality and load."""

from __future__ import annotations

from collections.abc import Sequence

from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.router.routing.registry import register_routing_policy


@register_routing_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(chosen.replica_id, "round_robin")
