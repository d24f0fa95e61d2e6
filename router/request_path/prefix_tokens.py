"""A tokenizer that reuses the token ids of text prefixes it saw recently, so a chat's new
turn (which resends the whole history) tokenizes only what is new.

A rendered chat is cut after special tokens (``HFTokenizer.split_tokens``: the message
delimiters of its template, such as ``<|im_end|>``, ``<|eot_id|>``). At such a cut the ids
of the whole are the ids of the part before followed by those of the part after, so the
ids of a prefix ending there can be kept and reused::

    turn 1:  [sys]<|im_end|> [u1]<|im_end|> <|im_start|>assistant\\n
                             cut ─────────┘  cut ─────┘        kept: the last two cuts
    turn 2:  [sys]<|im_end|> [u1]<|im_end|> <|im_start|>assistant\\n[a1]<|im_end|> [u2]...
             └──────── reused (a kept prefix) ─────────┘└── encoded now ──────────────┘

Each cut's key chains the previous key with the text between (one pass over the text);
a kept prefix is looked up from the last cut backwards and checked against the text
itself before use. Only ``add_special_tokens=False`` encodes (rendered chats) are served
this way; anything else is encoded whole.

A completion prompt has no such delimiters, but prompts often share a long head (a
system text, a document, few-shot examples). It is cut at word boundaries instead: the
first space between two word characters at or after every ``STRIDE`` characters. Byte-level
BPE (GPT-2, Llama 3, Qwen), Metaspace and whitespace pre-tokenizers never join a word with
the space before it into one token across such a point when the space starts the next
word, so the ids of the whole are again those of the pieces; the cut points depend only on
the text up to them, so two prompts sharing a head share its cuts. Every cut's prefix is
kept (not only the last ones), and the ids of a prompt with special tokens added are the
tokenizer's own special head (e.g. BOS) followed by the pieces' ids, where a self-test
shows that is what the tokenizer does.

Invariants:
    * ``encode`` returns exactly the wrapped tokenizer's ids for the same text; a startup
      self-test on the tokenizer's own special tokens and a full encode of every
      ``verify_every``-th reuse check it, and the first difference turns reuse off for
      good (logged).
    * The kept ids total at most ``max_tokens`` (least recently used dropped first).
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

KEEP_CUTS = 2  # the last cuts of each text kept: the next turn resends at least one of them
STRIDE = 1024  # characters between word-boundary cuts of a text without delimiters
_WORD_CUT = re.compile(r"(?<=\w) (?=\w)")
_PROBES = ("", "a", " a", "\n\n", "  x y", "Hello, world!", "123 456", "\u00e9t\u00e9 \u4e2d\u6587", "\ta\n b")


@dataclass(slots=True)
class _Prefix:
    text: str  # the prefix itself (a hit is checked against it)
    ids: array  # its token ids


class PrefixReusingTokenizer:
    """Wraps a tokenizer (see the module docstring); every other attribute is the wrapped
    tokenizer's.

    Args:
        tokenizer: the tokenizer (``split_tokens`` gives the cuts; without any, or when
            its self-test fails, every encode is whole).
        max_tokens: bound of the ids kept (default 1,000,000: about 4 MB plus the texts).
        verify_every: one reuse in this many is checked against a whole encode (default 64).
    """

    def __init__(self, tokenizer, max_tokens: int = 1_000_000, verify_every: int = 64):
        if max_tokens <= 0 or verify_every <= 0:
            raise ValueError("max_tokens and verify_every must be positive")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.verify_every = verify_every
        self._kept: OrderedDict[int, _Prefix] = OrderedDict()
        self.kept_tokens = 0
        self.hits = 0  # encodes that reused a kept prefix
        self.misses = 0  # encodes with cuts but no kept prefix
        self.reused_tokens = 0  # ids taken from kept prefixes instead of encoded
        self.mismatches = 0
        splits = tokenizer.split_tokens() if hasattr(tokenizer, "split_tokens") else []
        self._cuts = re.compile("|".join(re.escape(t) for t in sorted(splits, key=len, reverse=True))) if splits else None
        if self._cuts is not None and not self._self_test(splits):
            log.warning("tokenizer: cutting after its special tokens changes its ids; every prompt is tokenized whole")
            self._cuts = None
        # NOTE: word cuts need the same guarantee as the delimiters' (split_tokens gives []
        # for a tokenizer that treats its first piece apart), then a self-test of their own.
        self._special_head: list[int] | None = None
        self._word_cuts = self._cuts is not None and self._word_self_test()
        if self._cuts is not None and not self._word_cuts:
            log.info("tokenizer: cutting completion prompts at word boundaries changes its ids; they are tokenized whole")

    @property
    def enabled(self) -> bool:
        return self._cuts is not None

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def _self_test(self, splits: list[str]) -> bool:
        """Cutting after each split token, between every pair of probes, gives the ids of
        the whole."""
        enc = self.tokenizer.encode
        for token in splits:
            for left in _PROBES:
                for right in _PROBES:
                    head = left + token
                    if enc(head + right) != enc(head) + enc(right):
                        return False
        return True

    def _word_self_test(self) -> bool:
        """Cutting before the space of every probe's word boundary gives the ids of the
        whole, and adding special tokens puts one fixed head before the plain ids."""
        enc = self.tokenizer.encode
        words = ("Hello", "a", "x1", "\u00e9t\u00e9", "world", "Zz", "the")
        for left in _PROBES + words:
            for right in words:
                for head in ("", "a b. ", "x\n"):
                    whole = head + left + "w " + right + " tail"
                    cut = len(head + left + "w")
                    if enc(whole) != enc(whole[:cut]) + enc(whole[cut:]):
                        return False
        special = enc("", True)
        if any(enc(p, True) != special + enc(p) for p in _PROBES[1:] + words):
            return False
        self._special_head = special
        return True

    def _word_cut_points(self, text: str) -> list[int]:
        """The first word-boundary cut at or after every ``STRIDE`` characters."""
        cuts: list[int] = []
        at = STRIDE
        while at < len(text):
            m = _WORD_CUT.search(text, at)
            if m is None:
                break
            cuts.append(m.start())
            at = m.start() + STRIDE
        return cuts

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._cuts is None:
            return self.tokenizer.encode(text, add_special_tokens)
        if add_special_tokens:  # a completion prompt: word cuts, the tokenizer's own head
            if not self._word_cuts:
                return self.tokenizer.encode(text, True)
            return self._special_head + self._encode_cut(text, self._word_cut_points(text), keep_all=True)
        cuts = [m.end() for m in self._cuts.finditer(text)]
        return self._encode_cut(text, cuts, keep_all=False)

    def _encode_cut(self, text: str, cuts: list[int], keep_all: bool) -> list[int]:
        """``text``'s ids (no special tokens added), reusing the longest kept prefix that
        ends at one of ``cuts``; keeps the prefixes at the new cuts (all of them, or the
        last ``KEEP_CUTS``)."""
        if not cuts:
            return self.tokenizer.encode(text)
        keys: list[int] = []
        key, start = 0, 0
        for end in cuts:
            key = hash((key, text[start:end]))
            keys.append(key)
            start = end
        found = -1
        for i in range(len(cuts) - 1, -1, -1):
            kept = self._kept.get(keys[i])
            if kept is not None and len(kept.text) == cuts[i] and text.startswith(kept.text):
                found = i
                self._kept.move_to_end(keys[i])
                break
        enc = self.tokenizer.encode
        ids = array("I", self._kept[keys[found]].ids) if found >= 0 else array("I")
        start = cuts[found] if found >= 0 else 0
        first_kept = found + 1 if keep_all else max(found + 1, len(cuts) - KEEP_CUTS)
        for i in range(found + 1, len(cuts)):  # the new cuts: encoded piece by piece from the last reused one
            if i < first_kept:
                continue
            ids.extend(enc(text[start : cuts[i]]))
            start = cuts[i]
            self._keep(keys[i], text[: cuts[i]], ids)
        tail = enc(text[start:])
        out = ids.tolist() + tail
        if found >= 0:
            self.hits += 1
            self.reused_tokens += len(self._kept[keys[found]].ids)
            if self.hits % self.verify_every == 0 and not self._verified(text, out):
                return self.tokenizer.encode(text)
        else:
            self.misses += 1
        return out

    def _keep(self, key: int, prefix: str, ids: array) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            self.kept_tokens -= len(old.ids)
        self._kept[key] = _Prefix(prefix, array("I", ids))
        self.kept_tokens += len(ids)
        while self.kept_tokens > self.max_tokens and self._kept:
            _key, dropped = self._kept.popitem(last=False)
            self.kept_tokens -= len(dropped.ids)

    def _verified(self, text: str, ids: list[int]) -> bool:
        if self.tokenizer.encode(text) == ids:
            return True
        self.mismatches += 1
        self._cuts = None
        self._kept.clear()
        self.kept_tokens = 0
        log.warning("tokenizer: a reused prefix gave other ids than the whole text; every prompt is tokenized whole from now on")
        return False
