"""Registry of routing policies: name -> class. Add one with ``@register_routing_policy``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from unicache.router.routing.base import RoutingPolicy

_POLICIES: dict[str, type[RoutingPolicy]] = {}
P = TypeVar("P", bound=type[RoutingPolicy])

# Modules whose import registers the built-in policies.
BUILTIN_MODULES = [
    "unicache.router.routing.round_robin",
    "unicache.router.routing.least_loaded",
    "unicache.router.routing.session_affinity",
    "unicache.router.routing.sglang",
    "unicache.router.routing.cache_aware",
]


def register_routing_policy(name: str) -> Callable[[P], P]:
    def deco(cls: P) -> P:
        if name in _POLICIES:
            raise ValueError(f"routing policy {name!r} registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    for mod in BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


def routing_policy_names() -> list[str]:
    _load_builtin()
    return sorted(_POLICIES)


def make_routing_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """Build routing policy ``name``; unknown names raise ValueError listing the valid ones."""
    _load_builtin()
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(sorted(_POLICIES))})") from None
    return cls(**kwargs)
