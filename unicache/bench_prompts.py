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
"""

from __future__ import annotations

import xxhash

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
