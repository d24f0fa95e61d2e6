"""Registry of eviction policies: name -> class. Add one with ``@register_policy``.

The built-in policies' modules are imported on the first lookup; a missing one fails
the lookup loudly (see ``unicache.plumbing.registry``).
"""

from __future__ import annotations

from typing import Any

from unicache.plumbing.registry import Registry
from unicache.replica.eviction.base import EvictionPolicy

EVICTION_POLICIES: Registry[EvictionPolicy] = Registry(
    "eviction policy",
    [
        "unicache.replica.eviction.lru",
        "unicache.replica.eviction.fifo",
        "unicache.replica.eviction.lfu",
        "unicache.replica.eviction.arc",
        "unicache.replica.eviction.s3fifo",
        "unicache.replica.eviction.lecar",
        "unicache.replica.eviction.radix_lru",
        "unicache.replica.eviction.unicache",
        "unicache.replica.eviction.opt",
    ],
)

register_policy = EVICTION_POLICIES.register


def policy_names() -> list[str]:
    return EVICTION_POLICIES.names()


def make_host_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """The policy ``name`` builds for a host tier: the class's ``host_tier_policy`` where it
    names one (unicache: ``unicache.host.HostUniCachePolicy``), else ``make_policy``."""
    host_cls = getattr(EVICTION_POLICIES.get(name), "host_tier_policy", None)
    if host_cls is None:
        return make_policy(name, **kwargs)
    if kwargs:
        raise ValueError(f"the host tier's {name!r} policy takes no arguments (got {', '.join(sorted(kwargs))})")
    return host_cls()


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build the policy ``name``; kwargs go to its constructor. Unknown names or
    keywords raise ValueError listing the valid ones."""
    return EVICTION_POLICIES.make(name, **kwargs)
