"""Registry of eviction policies: name -> class. Add one with ``@register_policy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from unicache.replica.eviction.base import EvictionPolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {}
P = TypeVar("P", bound=type[EvictionPolicy])


def register_policy(name: str) -> Callable[[P], P]:
    def deco(cls: P) -> P:
        if name in _POLICIES:
            raise ValueError(f"eviction policy {name!r} registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    # Importing the modules registers the built-in policies.
    from unicache.replica.eviction import lru  # noqa: F401
    import importlib

    for mod in ("radix_lru", "unicache", "opt"):
        try:
            importlib.import_module(f"unicache.replica.eviction.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"unicache.replica.eviction.{mod}":
                raise


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_POLICIES)


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build the policy ``name``; kwargs go to its constructor. Unknown names raise ValueError."""
    _load_builtin()
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (choose from {', '.join(sorted(_POLICIES))})") from None
    return cls(**kwargs)
