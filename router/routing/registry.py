"""Registry of routing policies: name -> class. Add one with ``@register_routing_policy``.

The built-in policies' modules are imported on the first lookup; a missing one fails
the lookup loudly (see ``unicache.registry``).
"""

from __future__ import annotations

from typing import Any

from unicache.registry import Registry
from unicache.router.routing.base import RoutingPolicy

ROUTING_POLICIES: Registry[RoutingPolicy] = Registry(
    "routing policy",
    [
        "unicache.router.routing.round_robin",
        "unicache.router.routing.least_loaded",
        "unicache.router.routing.session_affinity",
        "unicache.router.routing.sglang",
        "unicache.router.routing.cache_aware",
    ],
)

register_routing_policy = ROUTING_POLICIES.register


def routing_policy_names() -> list[str]:
    return ROUTING_POLICIES.names()


def make_routing_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """Build routing policy ``name``; unknown names or keywords raise ValueError listing
    the valid ones."""
    return ROUTING_POLICIES.make(name, **kwargs)
