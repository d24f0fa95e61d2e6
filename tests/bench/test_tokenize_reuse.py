"""bench.tokenize_reuse's harness at a tiny size: the workload's turns interleave, every chat's
first turn misses and each later one reuses, and the reused encodes equal the whole ones
(the bench stops otherwise). No timing is asserted."""

from __future__ import annotations

import argparse

from bench.tokenize_reuse import measure


def test_the_harness_counts_one_miss_per_chat_and_reuses_every_later_turn():
    args = argparse.Namespace(workload="chats", chats=3, turns=4, words=12, rounds=2)
    for kind in ("chatml", "words"):
        row = measure(kind, args)
        assert (row["tokenizer"], row["prompts"], row["misses"], row["hits"]) == (kind, 12, 3, 9)
        assert 0 < row["reused_share"] < 1 and row["kept_tokens"] > 0
        assert set(row) >= {"whole_ms_per_prompt", "reuse_ms_per_prompt", "cpu_ratio_reuse_over_whole"}


def test_the_completions_workload_reuses_each_shared_head_after_its_first_prompt():
    args = argparse.Namespace(workload="completions", chats=2, turns=4, words=200, heads=2, rounds=2)
    row = measure("chatml", args)
    # 8 prompts of 2,000 words, 2 heads of 1,500: each head's first prompt misses, the rest reuse
    assert (row["workload"], row["prompts"], row["misses"], row["hits"]) == ("completions", 8, 2, 6)
    assert 0.5 < row["reused_share"] < 0.75
