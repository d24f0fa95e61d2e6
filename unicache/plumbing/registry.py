"""A named registry of plug-in classes (eviction policies, routing policies).

One instance per kind of plug-in. Built-in classes live in modules that register
themselves on import (``@registry.register("name")``); the registry imports those modules
the first time a name is looked up, so a reader never sees a partial set.

Invariants:
    * A name maps to one class; registering a name twice raises ``ValueError``.
    * Every built-in module is imported before the first lookup answers; one that cannot
      be imported raises (its ``ImportError``), never silently shrinks the set.
    * An unknown name, or a keyword the class's constructor does not take, raises
      ``ValueError`` naming the valid choices.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
    """name -> class of one kind of plug-in.

    Args:
        kind: what the plug-ins are, for error messages ("eviction policy").
        builtin_modules: modules whose import registers the built-in classes.
    """

    def __init__(self, kind: str, builtin_modules: Sequence[str]):
        self.kind = kind
        self.builtin_modules = tuple(builtin_modules)
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: register the class as ``name`` and set its ``name`` attribute."""

        def deco(cls: C) -> C:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def _load_builtin(self) -> None:
        if self._loaded:
            return
        for module in self.builtin_modules:
            importlib.import_module(module)
        self._loaded = True

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load_builtin()
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``; ``ValueError`` listing the valid names if none."""
        self._load_builtin()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r} (choose from {', '.join(self.names())})") from None

    def make(self, name: str, **kwargs: Any) -> T:
        """Build ``name`` with ``kwargs``; a keyword its constructor lacks is refused by name."""
        cls = self.get(name)
        params = inspect.signature(cls).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(kwargs) - set(params))
            if unknown:
                valid = ", ".join(params) or "none"
                raise ValueError(
                    f"{self.kind} {name!r} does not take {', '.join(unknown)} (its arguments: {valid})"
                )
        return cls(**kwargs)
