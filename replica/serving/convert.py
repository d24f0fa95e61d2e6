"""Protobuf <-> engine-type conversions for the replica service (pure functions, no I/O).

The servicer uses only these and ``replica/engines/api.py`` types, so the wire format and
the engine can change independently.
"""

from __future__ import annotations

from unicache.contract import wire
from unicache.contract.request_class import RequestClass
from unicache.replica.engines.api import CacheStateInfo, EngineInputError, EngineOutput, SamplingParams, Usage
from unicache.v1 import common_pb2, replica_pb2

FINISH_REASONS: dict[str | None, int] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES: dict[int, str | None] = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Proto defaults (0) mean "server default": max_tokens -> ``default_max_tokens``
    (None, up to the context, when ``fill_context``), top_p 0 -> 1.0 (only 0: a negative
    top_p is rejected, not silently widened), n 0 -> 1. Range checks (too many tokens,
    bad temperature, penalties) are the engine's: it raises ``EngineInputError`` with the
    limit in the message."""
    return SamplingParams(
        max_tokens=msg.max_tokens or (None if msg.fill_context else default_max_tokens),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,  # negative or NaN: the engine rejects it
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop=list(msg.stop),
        n=msg.n or 1,
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        stop_token_ids=list(msg.stop_token_ids),
    )


def request_class_from_proto(msg: common_pb2.RequestClass) -> RequestClass:
    """``unicache.contract.wire.request_class_from_proto`` with an unknown task as EngineInputError."""
    try:
        return wire.request_class_from_proto(msg)
    except ValueError as exc:
        raise EngineInputError("invalid", str(exc)) from None


def usage_to_proto(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        cached_tokens=u.cached_tokens,
        completion_tokens=u.completion_tokens,
        queue_time_s=u.queue_time_s,
        prefill_time_s=u.prefill_time_s,
    )


def output_to_proto(out: EngineOutput) -> replica_pb2.GenerateResponse:
    msg = replica_pb2.GenerateResponse(
        index=out.index,
        token_ids=out.new_token_ids,
        text=out.text_delta,
        finish_reason=FINISH_REASONS[out.finish_reason] if out.finished else common_pb2.FINISH_REASON_UNSPECIFIED,
    )
    if out.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(out.usage))
    if out.logprobs is not None:
        for lp in out.logprobs:
            msg.logprobs.add(logprob=lp.logprob, top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    return msg


def cache_state_to_proto(info: CacheStateInfo, replica_id: str) -> common_pb2.CacheState:
    return common_pb2.CacheState(
        replica_id=replica_id,
        block_size=info.block_size,
        capacity_blocks=info.capacity_blocks,
        used_blocks=info.used_blocks,
        free_blocks=info.free_blocks,
        cached_blocks=info.cached_blocks,
        hit_ratio=info.hit_ratio,
        queue_sizes=dict(info.queue_sizes),
        eviction_policy=info.eviction_policy,
        evictions=info.evictions,
        host=None if info.host is None else common_pb2.HostTierState(
            capacity_blocks=info.host.capacity_blocks,
            used_blocks=info.host.used_blocks,
            hit_ratio=info.host.hit_ratio,
            promotions=info.host.promotions,
            demotions=info.host.demotions,
            evictions=info.host.evictions,
            eviction_policy=info.host.eviction_policy,
        ),
    )
