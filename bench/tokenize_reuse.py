"""CPU the router spends tokenizing chats and completion prompts, with and without reusing
recent prefixes (``unicache.router.request_path.prefix_tokens``), in interleaved rounds of
one run.

A workload of ``--chats`` chats of ``--turns`` turns (each message ``--words`` words; a
client resends the whole history every turn, the chats interleaved as a router sees them)
is rendered with each tokenizer's chat template once; then each round tokenizes every
prompt with the tokenizer as it is, and with a fresh ``PrefixReusingTokenizer`` around
it (the order turning each round), measuring ``time.process_time()``. Every reused
encode is also checked equal to the whole one, outside the timed part. Tokenizers are
trained here in the shapes of real chat models (``unicache.testing.chat_tokenizers``:
ChatML / Qwen, Llama 3, and the project's word-level tiny Llama); their vocabularies are
small, so a prompt has more tokens than a real model's would, and the figures are
ratios, not a real tokenizer's milliseconds.

``--workload completions`` instead tokenizes ``--chats`` x ``--turns`` completion prompts
(with the tokenizer's special tokens, as the router encodes a completion) of ``--words``
x 10 words each, three quarters of them one of ``--heads`` shared heads and the rest their
own (the shape of ``bench.router_only``'s prompts workload).

Reports per tokenizer: CPU ms per prompt whole and reusing, their ratio (median over
rounds), the share of ids reused, and the kept ids.

Run (from the repository root; take the figures on an idle machine):
    .venv/bin/python -m bench.tokenize_reuse [--workload chats|completions] [--chats 20] [--turns 10] [--words 70]
        [--heads 8] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from unicache.contract.chat_template import render_chat
from unicache.contract.tokenizer import HFTokenizer
from unicache.router.request_path.prefix_tokens import PrefixReusingTokenizer
from unicache.testing.chat_tokenizers import chat_turns, chat_words, write_chat_tokenizer

KINDS = ("chatml", "llama3", "words")


def workload(tok: HFTokenizer, kind: str, chats: int, turns: int, words: int, seed: int = 0) -> list[str]:
    """The prompts in arrival order: turn 1 of every chat, then turn 2 of every chat, ..."""
    rng = random.Random(seed)
    all_turns = [chat_turns(rng, turns, words, kind) for _ in range(chats)]
    return [render_chat(chat[t], tok.chat_template) for t in range(turns) for chat in all_turns]


def completions(n: int, words: int, heads: int, seed: int = 0) -> list[str]:
    """``n`` completion prompts of ``words`` x 10 words: a shared head (three quarters of
    them, one of ``heads``) and a tail of their own."""
    rng = random.Random(seed)
    total = words * 10
    shared = [chat_words(rng, total * 3 // 4) for _ in range(heads)]
    return [shared[i % heads] + " " + chat_words(rng, total - total * 3 // 4) for i in range(n)]


def cpu_ms(encode, prompts: list[str]) -> tuple[float, list[list[int]]]:
    out = []
    t0 = time.process_time()
    for p in prompts:
        out.append(encode(p))
    return (time.process_time() - t0) * 1000.0, out


def measure(kind: str, args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tok = HFTokenizer(write_chat_tokenizer(d, kind))
    chats = args.workload == "chats"
    prompts = (workload(tok, kind, args.chats, args.turns, args.words) if chats
               else completions(args.chats * args.turns, args.words, args.heads))
    special = not chats  # a completion prompt is encoded with the tokenizer's special tokens
    whole_ms, reuse_ms, ratios = [], [], []
    reusing = None
    for r in range(args.rounds):
        reusing = PrefixReusingTokenizer(tok)
        runs = {}
        for name in (("whole", "reuse") if r % 2 == 0 else ("reuse", "whole")):
            plain = tok.encode if name == "whole" else reusing.encode

            def encode(p, plain=plain):
                return plain(p, special)
            runs[name] = cpu_ms(encode, prompts)
        if runs["whole"][1] != runs["reuse"][1]:
            raise SystemExit(f"{kind}: reused ids differ from whole encodes")
        whole_ms.append(runs["whole"][0] / len(prompts))
        reuse_ms.append(runs["reuse"][0] / len(prompts))
        ratios.append(runs["reuse"][0] / runs["whole"][0] if runs["whole"][0] else float("nan"))
    total = sum(len(ids) for ids in runs["whole"][1])
    return {
        "tokenizer": kind, "workload": args.workload, "prompts": len(prompts), "tokens_per_prompt": round(total / len(prompts)),
        "whole_ms_per_prompt": round(statistics.median(whole_ms), 4), "reuse_ms_per_prompt": round(statistics.median(reuse_ms), 4),
        "cpu_ratio_reuse_over_whole": round(statistics.median(ratios), 3),
        "reused_share": round(reusing.reused_tokens / total, 3), "kept_tokens": reusing.kept_tokens,
        "hits": reusing.hits, "misses": reusing.misses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("chats", "completions"), default="chats")
    ap.add_argument("--heads", type=int, default=8, help="shared heads of the completions workload")
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--words", type=int, default=70, help="words per user message (the system prompt as many, answers a quarter)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizers", default=",".join(KINDS))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [measure(kind, args) for kind in args.tokenizers.split(",")]
    print("| tokenizer | prompts | tokens/prompt | whole CPU ms/prompt | reusing CPU ms/prompt | ratio | ids reused |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['prompts']} | {r['tokens_per_prompt']} | {r['whole_ms_per_prompt']:.3f} | "
              f"{r['reuse_ms_per_prompt']:.3f} | {r['cpu_ratio_reuse_over_whole']:.2f} | {r['reused_share']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
