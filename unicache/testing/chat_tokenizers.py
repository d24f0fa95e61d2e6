"""Tokenizer directories in the shapes of real chat models, trained here (nothing is
downloaded), and chats to render with them: for tests and benchmarks of what the router
does with a rendered chat's tokens.

``write_chat_tokenizer(path, kind)`` writes tokenizer.json and tokenizer_config.json with
a chat template:

    kind        model family       pre-tokenizer                          message delimiters
    chatml      Qwen               GPT-2 byte-level regex                 <|im_start|> <|im_end|>
    llama3      Llama 3            Llama 3 split regex, then byte-level   <|start_header_id|> ... <|eot_id|>
    metaspace   Llama 2, Mistral   SentencePiece metaspace (prepend first) [INST] [/INST] </s>
    words       the tiny Llama     whitespace words (tiny_hf_model.py)    </s>, <s>
"""

from __future__ import annotations

import json
import os
import random

from unicache.testing.tiny_hf_model import WORDS
from unicache.testing.tiny_hf_model import train_tokenizer as train_word_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
METASPACE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KINDS = ("chatml", "llama3", "metaspace", "words")

_TEXT = (
    "The router sends each request to the server that already holds the longest part of its prompt, "
    "balanced against how busy each server is. Chats resend their whole history every turn, "
    "so most of a prompt was seen before: 42 tokens, 1,024 blocks, caf\u00e9, na\u00efve, \u4e2d\u6587. "
)


def chat_words(rng: random.Random, n: int) -> str:
    """``n`` words of English-like text (or tiny-Llama words for ``words``)."""
    vocab = _TEXT.split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def write_chat_tokenizer(path: str, kind: str) -> str:
    """Write the tokenizer directory ``kind`` (see the module docstring) at ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    if kind == "words":
        train_word_tokenizer(path, chat_template=True)
        return path
    corpus = [_TEXT * 4, *(chat_words(random.Random(i), 200) for i in range(20))]
    if kind == "metaspace":
        specials, template, bos, eos = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], METASPACE, "<s>", "</s>"
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Replace(" ", "\u2581")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    else:
        tok = Tokenizer(models.BPE())
        if kind == "chatml":
            specials, template, bos, eos = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML, None, "<|im_end|>"
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif kind == "llama3":
            specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
            template, bos, eos = LLAMA3, "<|begin_of_text|>", "<|eot_id|>"
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            raise ValueError(f"unknown tokenizer kind {kind!r} (known: {', '.join(KINDS)})")
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if kind != "metaspace" else [],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "chat_template": template}, f)
    return path


def chat_turns(rng: random.Random, turns: int, words_per_message: int, kind: str = "chatml") -> list[list[dict]]:
    """The message lists of one chat's turns: turn k holds a system message, k user
    messages and the k - 1 assistant answers between them (what a client resends)."""
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)) if kind == "words" else chat_words(rng, n)

    history: list[dict] = [] if kind == "metaspace" else [{"role": "system", "content": words(words_per_message)}]
    out = []
    for _ in range(turns):
        history.append({"role": "user", "content": words(words_per_message)})
        out.append(list(history))
        history.append({"role": "assistant", "content": words(max(1, words_per_message // 4))})
    return out
