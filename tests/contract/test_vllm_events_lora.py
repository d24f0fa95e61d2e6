"""A LoRA adapter's blocks in vLLM's events (unicache/contract/vllm_events.py): translated into
the hashes the router computes for a request naming the adapter
(``hash_token_blocks(..., adapter_id=name)``), so the index answers per adapter. vLLM puts the
adapter's name in ``lora_name`` and, untagged, first in each block's extra keys, before the
cache salt (vllm/distributed/kv_events.py); tests/e2e/test_vllm_models_live.py checks it
against a live server."""

from __future__ import annotations

import msgspec

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.vllm_events import EventTranslator, VllmBlockStored, VllmEventBatch, decode_batch

BS = 4


def translated(events) -> list[bytes]:
    t = EventTranslator(clock=lambda: 0.0)
    out = t.translate(decode_batch(msgspec.msgpack.encode(VllmEventBatch(ts=1.0, events=list(events)))))
    return [e.block_hash for e in out]


def test_an_adapters_blocks_hash_as_the_router_hashes_a_request_naming_it():
    toks = list(range(12))
    salt = bytes.fromhex("cd" * 8)
    ev = VllmBlockStored([1, 2, 3], None, toks, BS, lora_name="sql", extra_keys=[["sql", "cd" * 8], ["sql"], ["sql"]])
    assert translated([ev]) == hash_token_blocks(toks, BS, cache_salt=salt, adapter_id="sql")
    # The same tokens under another adapter, or none, are other blocks.
    other = VllmBlockStored([4, 5, 6], None, toks, BS, lora_name="chat", extra_keys=[["chat", "cd" * 8], ["chat"], ["chat"]])
    base = VllmBlockStored([7, 8, 9], None, toks, BS, extra_keys=[["cd" * 8], None, None])
    hashes = [translated([e])[0] for e in (ev, other, base)]
    assert len(set(hashes)) == 3 and hashes[2] == hash_token_blocks(toks, BS, cache_salt=salt)[0]


def test_a_release_naming_only_the_lora_id_keeps_its_blocks_apart_from_the_base_models():
    toks = list(range(8))
    ev = VllmBlockStored([1, 2], None, toks, BS, lora_id=3)
    assert translated([ev]) == hash_token_blocks(toks, BS, adapter_id="lora-id:3")
    assert translated([ev])[0] != hash_token_blocks(toks, BS)[0]


def test_an_adapter_without_a_salt_keys_every_block_by_its_name():
    toks = list(range(8))
    ev = VllmBlockStored([1, 2], None, toks, BS, lora_name="sql", extra_keys=[["sql"], ["sql"]])
    assert translated([ev]) == hash_token_blocks(toks, BS, adapter_id="sql")
