"""The live A/B's workload: trace requests turned into prompts, keys and sessions, and the
same workload written back as a trace for ``unicache sim`` (bench/live_ab.py).

Prompts are synthesized from hash ids, ``tokens_per_id`` words each (a word of the served
model's vocabulary is one token of the tiny Llama's word-level tokenizer, about one token
of a BPE one). Invariants:

    * word ``j`` of id ``k`` is ``vocab[xxh64("k:j") % len(vocab)]``: equal ids give equal
      text, independent of every other id, on every machine;
    * a request's last id gets the share of ``tokens_per_id`` that its ``input_length``
      leaves the trace's last block (at least one word), so a prompt is
      ``(len(hash_ids) - 1) * tokens_per_id + last`` words;
    * the simulator's trace has one block id per ``block_size`` words of a live prompt,
      keyed by (the id of the block's last word, that word's offset in its id): since an
      id stands for its whole prefix, equal keys are equal prefixes, so the simulator
      shares exactly the blocks vLLM can share.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import xxhash

from unicache.sim.trace import TraceRequest

DEFAULT_TENANT = "default"


@dataclass(slots=True)
class LiveRequest:
    """One request of the replay: ``at_s`` is its arrival at rate scale 1 (seconds after
    the trace's first request)."""

    index: int
    at_s: float
    prompt: str
    words: int
    max_tokens: int
    tenant: str
    session_id: str | None
    source: TraceRequest


def trace_block_size(requests: list[TraceRequest]) -> int:
    """The trace's tokens per block, inferred: the smallest power of two at least every
    request's ``input_length / len(hash_ids)`` (512 for Mooncake, 16 for the generator's
    default; ``--trace-block-size`` overrides it)."""
    need = max(math.ceil(r.input_length / len(r.hash_ids)) for r in requests)
    return 1 << max(0, math.ceil(math.log2(max(need, 1))))


def id_words(hash_id: int, tokens_per_id: int, vocab: list[str]) -> list[str]:
    """The ``tokens_per_id`` words of id ``hash_id``."""
    return [vocab[xxhash.xxh64_intdigest(f"{hash_id}:{j}".encode()) % len(vocab)] for j in range(tokens_per_id)]


def last_id_words(req: TraceRequest, trace_bs: int, tokens_per_id: int) -> int:
    """Words of a request's last id: its share of the trace's last block, scaled."""
    left = req.input_length - (len(req.hash_ids) - 1) * trace_bs
    return min(tokens_per_id, max(1, math.ceil(left / trace_bs * tokens_per_id)))


def build_requests(
    trace: list[TraceRequest], vocab: list[str], tokens_per_id: int, max_output_tokens: int,
    trace_bs: int | None = None, max_requests: int | None = None,
) -> list[LiveRequest]:
    """The replay's requests, in trace order (``trace`` is sorted by time)."""
    rows = trace[:max_requests] if max_requests else trace
    bs = trace_bs or trace_block_size(rows)
    base_ms = rows[0].timestamp_ms if rows else 0.0
    cache: dict[int, str] = {}
    out = []
    for i, r in enumerate(rows):
        parts = []
        for h in r.hash_ids[:-1]:
            if h not in cache:
                cache[h] = " ".join(id_words(h, tokens_per_id, vocab))
            parts.append(cache[h])
        last = last_id_words(r, bs, tokens_per_id)
        parts.append(" ".join(id_words(r.hash_ids[-1], tokens_per_id, vocab)[:last]))
        words = (len(r.hash_ids) - 1) * tokens_per_id + last
        out.append(LiveRequest(
            index=i, at_s=(r.timestamp_ms - base_ms) / 1000.0, prompt=" ".join(parts), words=words,
            max_tokens=max(1, min(r.output_length, max_output_tokens)), tenant=r.tenant or DEFAULT_TENANT,
            session_id=None if r.session_id is None else str(r.session_id), source=r,
        ))
    return out


def api_keys(requests: list[LiveRequest]) -> dict[str, str]:
    """One API key per tenant (``key-<n>``), in order of first appearance."""
    keys: dict[str, str] = {}
    for r in requests:
        keys.setdefault(r.tenant, f"key-{len(keys)}")
    return keys


def live_blocks(req: LiveRequest, tokens_per_id: int, block_size: int, keys: dict[tuple[int, int], int]) -> list[int]:
    """The block ids of ``req``'s prompt at ``block_size`` words per block (see the module
    docstring); ``keys`` numbers the (id, offset) keys across requests."""
    ids = req.source.hash_ids
    out = []
    for start in range(0, req.words, block_size):
        end = min(start + block_size, req.words) - 1  # the block's last word
        key = (ids[end // tokens_per_id], end % tokens_per_id)
        out.append(keys.setdefault(key, len(keys)))
    return out


def write_sim_trace(requests: list[LiveRequest], tokens_per_id: int, block_size: int, path: Path) -> int:
    """The live workload as a trace at ``block_size`` (docs/trace-format.md), labels kept;
    returns its unique blocks. Output blocks are left out: a later turn's prompt carries
    the text of its trace's output ids, never what the model generated, so live no turn
    hits a block decode wrote."""
    keys: dict[tuple[int, int], int] = {}
    with open(path, "w") as f:
        for r in requests:
            s = r.source
            row = {"timestamp": s.timestamp_ms, "input_length": r.words, "output_length": r.max_tokens,
                   "hash_ids": live_blocks(r, tokens_per_id, block_size, keys)}
            if s.session_id is not None:
                row["session_id"] = s.session_id
            for name in ("turn", "task", "tenant", "template"):
                value = getattr(s, name, None)
                if value is not None:
                    row[name] = getattr(value, "value", value)
            f.write(json.dumps(row) + "\n")
    return len(keys)


def unique_blocks(requests: list[LiveRequest], tokens_per_id: int, block_size: int) -> int:
    """Distinct prompt blocks of the workload at ``block_size`` (tenants apart)."""
    keys: dict[tuple[int, int], int] = {}
    seen = set()
    for r in requests:
        for b in live_blocks(r, tokens_per_id, block_size, keys):
            seen.add((r.tenant, b))
    return len(seen)
