"""Engine registry: ``--engine`` name -> a ``ServingEngine`` built from replica settings.

``torch`` is the built-in engine (the default); ``vllm`` runs vLLM's V1 engine in-process
(optional extra ``[vllm]``, imported only when chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unicache.replica.engines.api import ServingEngine
    from unicache.replica.settings import ReplicaSettings


def _torch(s: "ReplicaSettings") -> "ServingEngine":
    from unicache.replica.engines.builtin.async_engine import AsyncEngine

    return AsyncEngine(s.engine_config())


def _vllm(s: "ReplicaSettings") -> "ServingEngine":
    from unicache.replica.engines.vllm.engine import VLLMEngine

    return VLLMEngine(s.vllm_engine_config())


ENGINES: dict[str, Callable[["ReplicaSettings"], "ServingEngine"]] = {"torch": _torch, "vllm": _vllm}


def make_engine(settings: "ReplicaSettings") -> "ServingEngine":
    """Build (not start) the engine ``settings.engine`` names; unknown names raise ValueError."""
    try:
        build = ENGINES[settings.engine]
    except KeyError:
        raise ValueError(f"unknown engine {settings.engine!r} (choose from {', '.join(ENGINES)})") from None
    return build(settings)
