"""Least loaded: send each request to the replica with the fewest outstanding requests.

Ignores locality entirely; it is the load-only baseline and the fallback that other
policies (``session_affinity`` without a session) reuse through ``keys.pick_least_loaded``.

Order of comparison (first difference wins), so the choice is deterministic:
    1. ``ReplicaLoad.outstanding`` (max of the router's in-flight count and the
       replica's running + waiting),
    2. ``queued_prefill_tokens`` (uncached prompt work already queued),
    3. ``replica_id`` (lexicographic).
"""

from __future__ import annotations

from collections.abc import Sequence

from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.router.routing.keys import pick_least_loaded
from unicache.router.routing.registry import register_routing_policy


@register_routing_policy("least_loaded")
class LeastLoadedPolicy(RoutingPolicy):
    """Stateless: the decision depends only on the loads passed to ``choose``."""

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        chosen = pick_least_loaded(replicas)
        return RouteDecision(chosen.replica_id, "least_loaded", score=float(chosen.outstanding))
