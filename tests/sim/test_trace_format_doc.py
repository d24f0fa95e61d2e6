"""docs/trace-format.md stays true: its examples parse with the one reader, the generated
example keeps the relations the doc states, and the commands it shows exist."""

from __future__ import annotations

import re
import shlex

from unicache.cli.main import build_parser
from unicache.contract.block_hash import reusable_prompt_blocks
from unicache.sim.trace import parse_trace_line
from tests.support.source_tree import REPO

DOC = (REPO / "docs" / "trace-format.md").read_text()


def examples() -> list[list[str]]:
    return [block.strip().splitlines() for block in re.findall(r"```jsonl\n(.*?)```", DOC, flags=re.S)]


def test_the_examples_parse_and_keep_their_block_counts():
    mooncake, mix = examples()
    reqs = [parse_trace_line(line, "doc", i + 1, i) for i, line in enumerate(mooncake)]
    assert [(r.input_length, len(r.hash_ids)) for r in reqs] == [(6758, 14), (7322, 15)]
    for r in reqs:  # 512 tokens per block, the last may be partial
        assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512
    turn0, code1, code2, turn1 = (parse_trace_line(line, "doc", i + 1, i) for i, line in enumerate(mix))
    bs = 4
    assert len(turn0.output_hash_ids) == (turn0.input_length + turn0.output_length) // bs - len(turn0.hash_ids)
    assert turn1.hash_ids[:3] == turn0.hash_ids + turn0.output_hash_ids
    assert (turn1.session_id, turn1.turn, turn0.turn) == ("chat-0", 1, 0)
    assert reusable_prompt_blocks(turn1.input_length, bs) * bs == 12  # "serves 12 of its 15 tokens"
    assert code1.hash_ids[:2] == code2.hash_ids[:2] and code1.template and code2.template
    for r in (turn0, code1, code2, turn1):
        assert (len(r.hash_ids) - 1) * bs < r.input_length <= len(r.hash_ids) * bs


def test_the_commands_shown_parse():
    parser = build_parser()
    for cmd in re.findall(r"^(unicache (?:sim|gen-workload) .*?)$", DOC.replace("\\\n    ", ""), flags=re.M):
        parser.parse_args(shlex.split(cmd)[1:])
