"""vLLM's KV event wire structs in every form vLLM releases publish, decoded without vLLM.

A payload is ``msgspec.msgpack`` of ``KVEventBatch``: an array ``[ts, events,
data_parallel_rank?]``. The events inside come in two forms:

* ``array`` (vLLM up to 0.23): each event is an array whose first element is its tag,
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name?, extra_keys?, group_idx?, kv_cache_spec_kind?,
  kv_cache_spec_sliding_window?]`` (fields appear as releases added them; trailing
  defaults are left out);
* ``map`` (vLLM 0.24 on): each event is a map tagged by ``"type"``, with the same field
  names plus ``locality``, ``ownership``, ``session_id`` in later releases.

Both decode into the same classes (the array ones are subclasses of the map ones), so a
consumer reads ``VllmBlockStored`` whatever the form; ``schema_of`` tells which form a
batch came in. Unknown trailing fields (a newer release) are ignored. The recordings of
the releases tested are in ``tests/support/vllm_events/`` (``tools/record_vllm_events.py``).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"

SCHEMAS = {  # the forms decode_batch reads -> what publishes them
    "array": "vLLM before 0.24 (events are arrays tagged by their first element)",
    "map": "vLLM 0.24 or later (events are maps tagged by \"type\")",
}


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # deprecated by vLLM for lora_name
    medium: str | None = None  # "GPU", "CPU", "STORAGE" (None: GPU)
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block: LoRA name, mm keys, cache salt
    group_idx: int | None = None  # the KV cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", "mamba", ...
    kv_cache_spec_sliding_window: int | None = None  # tokens, for a sliding-window group
    session_id: str | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


# NOTE: the array form's classes subclass the map form's (isinstance holds for both); the
# session_id they inherit is never on the array wire (it came after the change), and
# msgspec needs each tag restated on the subclass.
class _ArrayBlockStored(VllmBlockStored, tag="BlockStored", array_like=True):
    pass


class _ArrayBlockRemoved(VllmBlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _ArrayAllBlocksCleared(VllmAllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


class _ArrayEventBatch(VllmEventBatch, array_like=True):
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]


_decoders = {"map": msgspec.msgpack.Decoder(type=VllmEventBatch), "array": msgspec.msgpack.Decoder(type=_ArrayEventBatch)}
_ARRAY_CLASSES = (_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared)


def decode_batch(payload: bytes, form: str = "map") -> VllmEventBatch:
    """One msgpack ``KVEventBatch`` of either form (``form``, a key of ``SCHEMAS``, is tried
    first); raises ``msgspec.DecodeError`` when neither form reads it."""
    other = "array" if form == "map" else "map"
    try:
        return _decoders[form].decode(payload)
    except msgspec.ValidationError:
        return _decoders[other].decode(payload)


def schema_of(batch: VllmEventBatch) -> str | None:
    """The form (a key of ``SCHEMAS``) ``batch`` came in; None for a batch without events
    (both forms read it alike)."""
    if not batch.events:
        return None
    return "array" if isinstance(batch.events[0], _ARRAY_CLASSES) else "map"
