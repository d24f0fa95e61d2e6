"""The request class and tenant salt as vLLM carries them (pure helpers).

The class rides in ``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` as the serialized
``unicache.v1.RequestClass`` message (the same codec as the wire, unicache/wire.py), so the
scheduler in vLLM's engine-core process decodes exactly what the router sent. The tenant
salt becomes vLLM's ``cache_salt`` (a string: the salt's hex), so two tenants never share
a block inside vLLM; the KV-event translator reads it back from the first block's extra
keys.
"""

from __future__ import annotations

from typing import Any

from unicache import wire
from unicache.request_class import SINGLE_TURN, RequestClass
from unicache.v1 import common_pb2

EXTRA_ARGS_KEY = "unicache_class"


def class_to_extra_args(cls: RequestClass) -> dict[str, Any]:
    return {EXTRA_ARGS_KEY: wire.request_class_to_proto(cls).SerializeToString()}


def class_from_extra_args(extra_args: dict[str, Any] | None) -> RequestClass:
    """The class a request carries; one without (a request not sent by us) is single-turn."""
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if raw is None:
        return SINGLE_TURN
    msg = common_pb2.RequestClass()
    msg.ParseFromString(bytes(raw))
    return wire.request_class_from_proto(msg)


def class_from_request(request: Any) -> RequestClass:
    """The class of a vLLM ``Request`` (engine-core side)."""
    params = getattr(request, "sampling_params", None)
    return class_from_extra_args(getattr(params, "extra_args", None))


def salt_to_vllm(salt: bytes | None) -> str | None:
    return salt.hex() if salt else None


def salt_from_vllm(cache_salt: str | None) -> bytes | None:
    return bytes.fromhex(cache_salt) if cache_salt else None
