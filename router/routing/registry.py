"""Registry of routing policies: name -> class. Add one with ``@register_routing_policy``.

The built-in policies' modules are imported on the first lookup; a missing one fails
the lookup loudly (see ``unicache.plumbing.registry``). A policy that takes one config object
names its class in ``config_class`` (a dataclass, e.g. ``CacheAwareConfig``):
``make_routing_policy(name, **kwargs)`` then builds the config from the keywords and the
policy from the config.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from unicache.plumbing.registry import Registry
from unicache.router.routing.base import RoutingPolicy

ROUTING_POLICIES: Registry[RoutingPolicy] = Registry(
    "routing policy",
    [
        "unicache.router.routing.baselines.round_robin",
        "unicache.router.routing.baselines.least_loaded",
        "unicache.router.routing.baselines.session_affinity",
        "unicache.router.routing.baselines.sglang",
        "unicache.router.routing.cache_aware.policy",
    ],
)

register_routing_policy = ROUTING_POLICIES.register


def routing_policy_names() -> list[str]:
    return ROUTING_POLICIES.names()


def routing_policy_parameters(name: str) -> list[str]:
    """The keywords ``make_routing_policy(name, ...)`` takes: its config's fields, or its
    constructor's parameters."""
    cls = ROUTING_POLICIES.get(name)
    config_class = getattr(cls, "config_class", None)
    if config_class is not None:
        return [f.name for f in dataclasses.fields(config_class)]
    return list(inspect.signature(cls).parameters)


def make_routing_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """Build routing policy ``name``; unknown names or keywords raise ValueError listing
    the valid ones, and a config refuses values out of range (ValueError)."""
    cls = ROUTING_POLICIES.get(name)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        return ROUTING_POLICIES.make(name, **kwargs)
    params = routing_policy_parameters(name)
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(
            f"{ROUTING_POLICIES.kind} {name!r} does not take {', '.join(unknown)} (its arguments: {', '.join(params)})"
        )
    return cls(config_class(**kwargs))
