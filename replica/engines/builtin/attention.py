"""Paged attention in plain torch: K/V written to and read from the KV store by slot.

A step's batch is a flat list of new tokens (prefill chunks and decode tokens mixed).
``slot_mapping[t]`` is where token t's K/V goes (``block_id * block_size + offset``).
Keys are read back through each sequence's block table, so a prefill chunk attends to
the cached prefix (computed by an earlier request) plus its own new tokens under a
causal mask, and a decode token attends to its whole context.

Invariant: a query at absolute position p sees exactly the keys at positions 0..p of its
own sequence (with a sliding window W: positions p-W+1..p, as transformers' sliding-window
mask), whatever mix of cached and new tokens produced them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """One sequence with ``q_len`` new tokens at rows ``q_start..`` and ``ctx_len`` keys in all.

    ``slots`` holds the cache slots of all ``ctx_len`` keys in position order; ``mask`` is
    ``[q_len, ctx_len]`` (True = may attend), or None when the segment has no cached
    prefix (plain causal attention over the new tokens).
    """

    q_start: int
    q_len: int
    ctx_len: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeBatch:
    """Single-token queries: rows ``rows`` of the flat batch, keys padded to the longest context.

    ``slots`` is ``[B, max_ctx]`` (padding points at slot 0), ``mask`` ``[B, 1, 1, max_ctx]``.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs; ``windowed`` is the same batch masked to ``window`` keys.

    ``windowed`` is set (by ``build_metadata(..., sliding_window=W)``) for models whose
    layers attend through a sliding window; those layers use it, the others this one.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSegment]
    decode: DecodeBatch | None
    window: int | None = None
    windowed: "AttentionMetadata | None" = None


def build_metadata(
    chunks: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for a batch of ``(block_table, start, end)`` chunks, in batch row order.

    Each chunk computes positions ``start..end-1`` of its sequence; a chunk with
    ``end - start == 1`` and ``start > 0`` is treated as a decode token. With
    ``sliding_window`` W, ``windowed`` holds the masks of a W-token window as well.
    """
    full = _build(chunks, block_size, device, None)
    if sliding_window is not None:
        full.windowed = _build(chunks, block_size, device, sliding_window)
    return full


def _build(chunks, block_size: int, device: torch.device, window: int | None) -> AttentionMetadata:
    slot_parts: list[torch.Tensor] = []
    prefills: list[PrefillSegment] = []
    dec_rows: list[int] = []
    dec_slots: list[torch.Tensor] = []
    row = 0
    for table, start, end in chunks:
        q_len = end - start
        all_slots = _slots(table, end, block_size)
        slot_parts.append(all_slots[start:end])
        if q_len == 1 and start > 0:
            dec_rows.append(row)
            dec_slots.append(all_slots)
        else:
            mask = None
            if start > 0 or (window is not None and q_len > window):
                q_pos = torch.arange(start, end, device=device)[:, None]
                k_pos = torch.arange(end, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            prefills.append(PrefillSegment(row, q_len, end, all_slots.to(device), mask))
        row += q_len
    decode = None
    if dec_rows:
        lens = torch.tensor([len(s) for s in dec_slots])
        padded = torch.nn.utils.rnn.pad_sequence(dec_slots, batch_first=True, padding_value=0)
        k_pos = torch.arange(padded.shape[1])[None, :]
        mask = k_pos < lens[:, None]
        if window is not None:
            mask &= k_pos >= lens[:, None] - window
        mask = mask[:, None, None, :]
        decode = DecodeBatch(
            torch.tensor(dec_rows, dtype=torch.long, device=device),
            padded.to(device),
            mask.to(device),
        )
    return AttentionMetadata(torch.cat(slot_parts).to(device), prefills, decode, window)


def _slots(table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions ``0..num_tokens-1`` through ``table`` (a CPU long tensor)."""
    n_blocks = -(-num_tokens // block_size)
    ids = torch.tensor(table[:n_blocks], dtype=torch.long)
    return (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_kv_groups: int,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend. Shapes: q ``[T, H, D]``, k/v ``[T, KVH, D]``.

    Returns ``[T, H, D]``.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    # NOTE: 4-D inputs (batch, heads, len, dim) select torch's fused CPU/GPU kernels; the
    # 3-D form falls back to the math path, ~10x slower on CPU.
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if seg.mask is None:
            # No cached prefix: the new tokens are the whole context, no gather needed.
            ks, vs = k[rows], v[rows]
        else:
            ks = k_cache.index_select(0, seg.slots)
            vs = v_cache.index_select(0, seg.slots)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        if seg.mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=num_kv_groups > 1)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, enable_gqa=num_kv_groups > 1)
        out[rows] = o[0].transpose(0, 1)
    dec = meta.decode
    if dec is not None:
        qd = q.index_select(0, dec.rows).unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[dec.slots].permute(0, 2, 1, 3)  # [B, KVH, ctx, D]
        vd = v_cache[dec.slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, enable_gqa=num_kv_groups > 1)
        out.index_copy_(0, dec.rows, o.squeeze(2))
    return out
