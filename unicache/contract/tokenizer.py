"""Tokenizers shared by replicas and the router. MUST NOT import torch (the router has none).

``ByteTokenizer`` (default, no files): ids 0..255 are bytes, then ``<bos>``, ``<eos>``,
``<pad>``. ``HFTokenizer`` wraps a Hugging Face ``tokenizer.json`` via ``tokenizers``.
Both offer ``encode``, ``decode``, ``vocab_size``, ``eos_token_id``, ``bos_token_id``,
``chat_template`` (``unicache.contract.chat_template.ChatTemplate``: the byte-level template, or the
one in the tokenizer's directory, or None) and ``detokenizer()``: an incremental decoder
for streaming whose deltas never split a UTF-8 character (concatenated deltas equal
``decode`` of all ids).

``encode`` recognises special tokens in the text (a rendered chat template's
``<|begin_of_text|>`` becomes its id). It adds none unless ``add_special_tokens=True``,
which applies the tokenizer's post-processor (a Llama ``tokenizer.json`` prepends BOS):
vLLM's rule is True for a completion prompt and False for a rendered chat template (which
carries its own BOS), as transformers' ``apply_chat_template`` tokenizes. The byte-level
tokenizer has no post-processor: both give the same ids.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Protocol

from unicache.contract.chat_template import BYTE_CHAT_TEMPLATE, ChatTemplate


class IncrementalDetokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text (maybe empty)."""

    def flush(self) -> str:
        """End of stream: return any held-back text."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: ChatTemplate | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; special ids decode to nothing."""

    NUM_BYTES = 256

    def __init__(self) -> None:
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.pad_token_id = 258
        self.vocab_size = 259
        self.chat_template = BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes; no post-processor, so ``add_special_tokens`` adds nothing."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < self.NUM_BYTES).decode("utf-8", errors="replace")

    def detokenizer(self) -> "_ByteDetokenizer":
        return _ByteDetokenizer()


class _ByteDetokenizer:
    def __init__(self) -> None:
        # The incremental UTF-8 decoder holds an incomplete trailing character back.
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if 0 <= token_id < ByteTokenizer.NUM_BYTES:
            return self._dec.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (fast tokenizer, no transformers needed)."""

    def __init__(self, path: str, eos_token: str | None = None, bos_token: str | None = None):
        from tokenizers import Tokenizer as _HF

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self._tok = _HF.from_file(path)
        # NOTE: encode_batch_fast (tokenizers >= 0.21) gives the same ids without computing
        # each token's offsets and strings; the router tokenizes every prompt it routes
        # (bench/results/ab_tokenizer_fast.md: 5-20% less router CPU per request).
        self._encode_fast = getattr(self._tok, "encode_batch_fast", None)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        directory = os.path.dirname(path)
        cfg = special_tokens(directory)
        eos = eos_token or cfg.get("eos_token") or _first_present(self._tok, ("</s>", "<|endoftext|>", "<eos>"))
        bos = bos_token or cfg.get("bos_token") or _first_present(self._tok, ("<s>", "<|begin_of_text|>", "<bos>"))
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        self.chat_template = ChatTemplate.from_directory(directory, cfg)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._encode_fast is not None:
            return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def split_tokens(self) -> list[str]:
        """The special tokens right after which a text may be cut, each side encoded alone
        (``add_special_tokens=False``) and the ids concatenated, equal to the whole text's.

        Why that holds: ``tokenizers`` cuts its input at added tokens matched on the raw
        text before it normalizes and pre-tokenizes each piece apart. Not for a token
        matched after normalization or one that takes the whitespace beside it (``lstrip``,
        ``rstrip``, ``single_word``), and for none when a pre-tokenizer or normalizer
        treats the input's first piece apart (``prepend_scheme: first``): [] then.
        """
        config = json.loads(self._tok.to_str())
        if _mentions(config.get("normalizer"), "prepend_scheme", "first") or _mentions(config.get("pre_tokenizer"), "prepend_scheme", "first"):
            return []
        return sorted(
            t.content for t in self._tok.get_added_tokens_decoder().values()
            if t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word) and t.content
        )

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def detokenizer(self) -> "_HFDetokenizer":
        return _HFDetokenizer(self)


class _HFDetokenizer:
    """Prefix/read offsets (as vLLM): decode a short window and emit only stable text.

    Text ending in U+FFFD is an incomplete byte sequence (byte-fallback tokens): hold it.
    """

    def __init__(self, tok: HFTokenizer):
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens(directory: str) -> dict[str, str]:
    """The named special tokens transformers reads for a tokenizer directory, as strings.

    From ``tokenizer_config.json`` (a token may be a string or an ``AddedToken`` dict with
    ``content``); a legacy ``special_tokens_map.json`` overrides them when the config has no
    ``added_tokens_decoder``, as transformers does.
    """
    cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    merged = dict(cfg)
    if "added_tokens_decoder" not in cfg:
        merged.update(_read_json(os.path.join(directory, "special_tokens_map.json")))
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        val = merged.get(key)
        if isinstance(val, dict):
            val = val.get("content")
        if isinstance(val, str):
            out[key] = val
    return out


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _mentions(node, key: str, value: str) -> bool:
    """Whether ``key: value`` appears anywhere in a tokenizer.json component (nested
    sequences included)."""
    if isinstance(node, dict):
        return node.get(key) == value or any(_mentions(v, key, value) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, key, value) for v in node)
    return False


def _first_present(tok, candidates: tuple[str, ...]) -> str | None:
    for c in candidates:
        if tok.token_to_id(c) is not None:
            return c
    return None


def load_tokenizer(path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``ByteTokenizer`` when ``path`` is None, else the tokenizer.json at (or in) ``path``."""
    if path is None:
        return ByteTokenizer()
    target = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(target):
        raise FileNotFoundError(f"tokenizer file not found: {target}")
    return HFTokenizer(target)
