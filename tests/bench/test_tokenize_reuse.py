"""bench.tokenize_reuse's harness at a tiny size: the workload's turns interleave, every chat's
first turn misses and each later one reuses, and the reused encodes equal the whole ones
(the bench stops otherwise). No timing is asserted."""

from __future__ import annotations

import argparse

from bench.tokenize_reuse import measure


def test_the_harness_counts_one_miss_per_chat_and_reuses_every_later_turn():
    args = argparse.Namespace(chats=3, turns=4, words=12, rounds=2)
    for kind in ("chatml", "words"):
        row = measure(kind, args)
        assert (row["tokenizer"], row["prompts"], row["misses"], row["hits"]) == (kind, 12, 3, 9)
        assert 0 < row["reused_share"] < 1 and row["kept_tokens"] > 0
        assert set(row) >= {"whole_ms_per_prompt", "reuse_ms_per_prompt", "cpu_ratio_reuse_over_whole"}
