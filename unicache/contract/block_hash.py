"""The one definition of the chained block hash, shared by router, replicas and simulator.

A block's hash covers its parent block's hash, the block's token ids and a tuple of
extra keys (the tenant's cache salt on the first block, an adapter id on every block).
Equal hashes therefore mean equal *whole prefixes*, not just equal blocks.

Invariants:
    * Deterministic across processes and machines: xxh3-128 with a fixed seed, and a
      fixed little-endian byte encoding (no ``hash()``, no PYTHONHASHSEED dependence).
    * A block hash is 16 bytes. ``ROOT_HASH`` (16 zero bytes) is the parent of the first
      block.
    * Only full blocks are hashed by ``hash_token_blocks``; a trailing partial block is
      never cached.
    * A prompt of n tokens takes at most ``reusable_prompt_blocks(n, block_size)`` blocks
      from a cache: its last token is always computed. Replica, simulator and test fakes
      all cap their hits with it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)

ROOT_HASH = BlockHash(bytes(16))
_SEP = b"\x1f"


def _encode_extra(extra_keys: Sequence[str | bytes | int]) -> bytes:
    parts = []
    for key in extra_keys:
        if isinstance(key, bytes):
            parts.append(b"b" + key)
        elif isinstance(key, str):
            parts.append(b"s" + key.encode("utf-8"))
        elif isinstance(key, int):
            parts.append(b"i" + key.to_bytes(8, "little", signed=True))
        else:
            raise TypeError(f"extra key must be str, bytes or int, got {type(key).__name__}")
    return _SEP.join(parts)


def hash_block(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | bytes | int] = (),
) -> BlockHash:
    """Hash one block given its parent's hash, its token ids and its extra keys.

    Args:
        parent: the previous block's hash, or ``ROOT_HASH`` for the first block.
        token_ids: the block's token ids (non-negative, < 2**32).
        extra_keys: salts and adapter ids that must separate otherwise equal blocks.
    """
    h = xxhash.xxh3_128(parent)
    h.update(array("I", token_ids).tobytes())
    if extra_keys:
        h.update(_SEP)
        h.update(_encode_extra(extra_keys))
    return BlockHash(h.digest())


def block_extra_keys(
    index: int, cache_salt: bytes | None, adapter_id: str | None
) -> tuple[str | bytes, ...]:
    """Extra keys of block ``index``: the salt on block 0 only, the adapter on every block."""
    keys: list[str | bytes] = []
    if index == 0 and cache_salt:
        keys.append(cache_salt)
    if adapter_id:
        keys.append(adapter_id)
    return tuple(keys)


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: bytes | None = None,
    adapter_id: str | None = None,
    parent: BlockHash = ROOT_HASH,
    start_index: int = 0,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``.

    ``parent``/``start_index`` continue an existing chain (e.g. hashing decode blocks
    after the prompt's blocks).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = len(token_ids) // block_size
    if not n_full:
        return []
    # NOTE: hash_block block by block, in one pass: the token ids are encoded once and
    # each block's bytes (parent + tokens + extra keys) hashed in one call; the same bytes,
    # so the same hashes (tests/contract/test_block_hash.py), at a fraction of the per-block cost
    # (the router hashes every prompt on the request path).
    raw = array("I", token_ids[: n_full * block_size]).tobytes()
    step = 4 * block_size
    tails = []
    for index in (0, 1):
        extra = block_extra_keys(index, cache_salt, adapter_id)
        tails.append(_SEP + _encode_extra(extra) if extra else b"")
    digest = xxhash.xxh3_128_digest
    hashes: list[BlockHash] = []
    for i in range(n_full):
        parent = digest(parent + raw[i * step : (i + 1) * step] + tails[start_index + i != 0])
        hashes.append(parent)
    return hashes


def hash_id_blocks(
    hash_ids: Sequence[int],
    cache_salt: bytes | None = None,
    parent: BlockHash = ROOT_HASH,
    start_index: int = 0,
) -> list[BlockHash]:
    """Chained hashes for a trace's ``hash_ids`` (one id stands for one block's tokens).

    Traces already give prefix identities; chaining them through ``hash_block`` keeps one
    hash space for traces and real tokens, and lets the tenant salt separate tenants.
    ``parent``/``start_index`` continue a chain, as in ``hash_token_blocks``.
    """
    hashes: list[BlockHash] = []
    for i, hid in enumerate(hash_ids):
        parent = hash_block(parent, (hid,), block_extra_keys(start_index + i, cache_salt, None))
        hashes.append(parent)
    return hashes


def reusable_prompt_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks of an ``num_prompt_tokens``-token prompt a cache hit may cover.

    At least the prompt's last token is computed, because its logits give the first
    output token; so a prompt that is all cached full blocks still computes its last
    block: ``(num_prompt_tokens - 1) // block_size``, 0 for an empty prompt.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return max(num_prompt_tokens - 1, 0) // block_size


def short(block_hash: BlockHash) -> str:
    """Human-readable prefix of a hash for logs and the CLI."""
    return block_hash[:6].hex()
