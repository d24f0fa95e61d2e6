"""``unicache demo``'s eviction phase against an in-process router and two real replicas:
the caches fill and evict, and what the demo reports UniCache kept is what an LRU cache of
the same size loses (the same demo against LRU replicas serves 0 of those tokens)."""

from __future__ import annotations

import asyncio
import re

import pytest

from unicache.cli.demo import build_workload, returning_requests
from unicache.cli.demo_eviction import FillReport, ReplicaFill, flood_text
from unicache.cli.main import main
from tests.support.load_stack import LoadStack

DEMO = ["--sessions", "2", "--turns", "2", "--templated", "4", "--single", "2", "--max-tokens", "2",
        "--concurrency", "2", "--flood-chars", "400", "--seed", "1"]


def test_flood_prompts_are_distinct_from_their_first_block_and_sized():
    texts = [flood_text(0, i, 600) for i in range(50)]
    assert all(len(t) == 600 for t in texts)
    assert len({t[:16] for t in texts}) == 50  # no two share a first 16-token block (bytes)
    assert flood_text(0, 7, 600) == texts[7]


def test_the_lru_comparison_is_claimed_only_for_replicas_that_took_a_cache_of_one_offs():
    report = FillReport(block_size=16, replicas={"a": ReplicaFill(10, evictions_before=3), "b": ReplicaFill(10)})
    report.add_flood("a", 16 * 10 + 15)  # 10 full blocks: filled
    report.add_flood("b", 16 * 9)
    assert (report.replicas["a"].filled, report.replicas["b"].filled, report.all_filled()) == (True, False, False)
    report.add_returning("a", 100, 64)
    report.add_returning("b", 50, 48)
    assert report.lines()[-1].startswith("UniCache kept 64 of 100 returning prompt tokens through the flood")


def test_returning_requests_continue_each_session_and_reuse_each_template():
    workload = build_workload(seed=1, sessions=2, turns=2, templated=4, single=2)
    back = returning_requests(workload)
    sessions = [r for r in back if r.chat is not None]
    assert [r.session_id for r in sessions] == ["demo-1-0", "demo-1-1"]
    last = {r.session_id: r for r in workload if r.kind == "session"}
    for r in sessions:
        assert r.chat[: len(last[r.session_id].chat)] == last[r.session_id].chat
    templates = [r.text for r in back if r.chat is None]
    assert templates and all(t.endswith("\nInput again: after the flood") for t in templates)


async def _demo(policy: str, capsys) -> tuple[str, dict[str, tuple[int, int, int, int]]]:
    stack = await LoadStack.start(num_replicas=2, router={"routing_policy": "cache_aware"},
                                  eviction_policy=policy, num_blocks=64, block_size=16)
    try:
        capsys.readouterr()
        rc = await asyncio.to_thread(main, ["demo", "--router", f"127.0.0.1:{stack.app.grpc_port}", "--api-key", "key-acme", *DEMO])
        captured = capsys.readouterr()
        out = captured.out
    finally:
        await stack.close()
    assert rc == 0, captured.err[-3000:]
    rows = {m[0]: tuple(map(int, m[1:])) for m in re.findall(
        r"^  (r\d): (\d+) one-off blocks into a (\d+)-block cache, (\d+) evictions; returning requests: (\d+) of \d+", out, flags=re.M)}
    return out, rows


@pytest.mark.slow
async def test_the_demo_fills_the_caches_and_unicache_keeps_what_lru_loses(capsys):
    out, rows = await _demo("unicache", capsys)
    assert sorted(rows) == ["r0", "r1"]
    for flood, capacity, evictions, _ in rows.values():
        assert flood >= capacity == 64 and evictions > 0
    kept = re.search(r"^UniCache kept (\d+) of (\d+) returning prompt tokens", out, flags=re.M)
    assert kept and int(kept.group(1)) == sum(r[3] for r in rows.values()) > 0
    _, lru_rows = await _demo("lru", capsys)
    assert [r[3] for r in lru_rows.values()] == [0, 0]  # what the demo says LRU would serve
