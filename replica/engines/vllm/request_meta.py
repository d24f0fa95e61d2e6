"""The request class and tenant salt as vLLM carries them (pure helpers).

The class rides in ``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` as the serialized
``unicache.v1.RequestClass`` message, base64 (``unicache.contract.vllm_events``: the same value a
router sends a stock vLLM server as ``vllm_xargs``), so the
scheduler in vLLM's engine-core process decodes exactly what the router sent. The tenant
salt becomes vLLM's ``cache_salt`` (a string: the salt's hex), so two tenants never share
a block inside vLLM; the KV-event translator reads it back from the first block's extra
keys.
"""

from __future__ import annotations

from typing import Any

from unicache.contract import wire
from unicache.contract.request_class import SINGLE_TURN, RequestClass
from unicache.contract.vllm_events import EXTRA_ARGS_KEY, class_from_vllm, class_to_vllm, salt_from_vllm, salt_to_vllm

__all__ = ["EXTRA_ARGS_KEY", "class_to_extra_args", "class_from_extra_args", "class_from_request", "salt_from_vllm", "salt_to_vllm"]


def class_to_extra_args(cls: RequestClass) -> dict[str, Any]:
    return {EXTRA_ARGS_KEY: class_to_vllm(wire.request_class_to_proto(cls))}


def class_from_extra_args(extra_args: dict[str, Any] | None) -> RequestClass:
    """The class a request carries; one without (a request not sent by us) is single-turn."""
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if raw is None:
        return SINGLE_TURN
    try:
        return wire.request_class_from_proto(class_from_vllm(raw))
    except ValueError:
        return SINGLE_TURN  # a client's own, malformed value: treated as one without


def class_from_request(request: Any) -> RequestClass:
    """The class of a vLLM ``Request`` (engine-core side)."""
    params = getattr(request, "sampling_params", None)
    return class_from_extra_args(getattr(params, "extra_args", None))

