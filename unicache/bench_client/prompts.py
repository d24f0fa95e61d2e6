"""Prompt text synthesized from a trace's hash ids: the one definition ``unicache bench`` uses.

Invariants:
  * block ``i`` at ``tokens_per_block`` B is B words, each a space and a word of ``VOCAB``;
    word ``j`` of block ``i`` is ``VOCAB[xxh64("i:j") % len(VOCAB)]``: the same on every
    machine and Python version, independent of any other block;
  * a prompt is the concatenation of its blocks' text, the last block cut to the words that
    ``input_length`` leaves it; so equal id prefixes give equal text prefixes (equal ids,
    equal text) and a partial block's text is a prefix of its full text;
  * a word is meant to be about one token of a BPE tokenizer (short, common, lower case),
    so B approximates tokens per block there; a byte tokenizer sees more tokens per block.

``fit_request`` cuts a request to an endpoint's context (``max_model_len``) for any
tokenizer that makes at most one token per byte (byte-level BPE, bytes): the prompt keeps
its first words, so requests that shared a prefix still share it.
"""

from __future__ import annotations

import dataclasses

import xxhash

from unicache.sim.trace import TraceRequest

# Tokens a tokenizer may add around a prompt (BOS and the like).
SPECIAL_TOKENS_RESERVE = 8

# Short common English words (each one BPE token with a leading space in GPT-style vocabularies).
VOCAB: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all",
    "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if",
    "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him",
)  # fmt: skip


def block_words(block_id: int, tokens_per_block: int) -> list[str]:
    """The ``tokens_per_block`` words of block ``block_id``."""
    return [VOCAB[xxhash.xxh64_intdigest(f"{block_id}:{j}".encode()) % len(VOCAB)] for j in range(tokens_per_block)]


def block_text(block_id: int, tokens_per_block: int, words: int | None = None) -> str:
    """Text of block ``block_id``: its first ``words`` words (all by default), each after a space."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    ws = block_words(block_id, tokens_per_block)
    return "".join(" " + w for w in ws[: tokens_per_block if words is None else words])


def prompt_text(hash_ids: list[int], input_length: int, tokens_per_block: int) -> str:
    """The prompt of a trace request: full blocks for every id but the last, which gets the
    ``input_length - (len(hash_ids) - 1) * tokens_per_block`` words left (clamped to [1, B])."""
    if not hash_ids:
        raise ValueError("hash_ids must not be empty")
    last = input_length - (len(hash_ids) - 1) * tokens_per_block
    last = min(max(last, 1), tokens_per_block)
    parts = [block_text(i, tokens_per_block) for i in hash_ids[:-1]]
    parts.append(block_text(hash_ids[-1], tokens_per_block, last))
    return "".join(parts)


def fit_request(req: TraceRequest, tokens_per_block: int, max_model_len: int) -> TraceRequest:
    """``req`` cut to fit a context of ``max_model_len`` tokens (itself when it fits).

    ``max_tokens`` (the output length) is capped at a quarter of the context; the prompt
    then keeps as many leading words as fit in the rest, counted as one token per byte of
    text (the most a byte-level tokenizer makes), less ``SPECIAL_TOKENS_RESERVE``. The hash
    ids keep the blocks those words cover, so the cut prompt is a prefix of the full one.

    Raises:
        ValueError: a context too small for one word and one output token.
    """
    output = min(max(1, req.output_length), max(1, max_model_len // 4))
    budget = max_model_len - output - SPECIAL_TOKENS_RESERVE
    text = prompt_text(req.hash_ids, req.input_length, tokens_per_block)
    if len(text.encode()) <= budget and output == max(1, req.output_length):
        return req
    words, size = 0, 0
    for word in text.split(" ")[1:]:  # the text is " w1 w2 ...": ASCII, a byte per character
        if size + 1 + len(word) > budget:
            break
        size += 1 + len(word)
        words += 1
    if words < 1:
        raise ValueError(f"a context of {max_model_len} tokens leaves no room for a prompt")
    blocks = -(-words // tokens_per_block)
    return dataclasses.replace(req, input_length=words, output_length=output, hash_ids=req.hash_ids[:blocks])
