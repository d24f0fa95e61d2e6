"""UniCache's recency guard (replica/eviction/unicache/guard.py): it falls back toward LRU
where UniCache's class order loses to recency, and keeps UniCache's wins where classes
matter. Hit counts come from deterministic runs of the simulator's model of vLLM
(``unicache.sim.vllm_replay``, one request at a time)."""

from __future__ import annotations

import json
import random

import pytest

from unicache.replica.eviction.unicache.guard import RecencyGuard
from unicache.sim.prepare import prepare
from unicache.sim.trace import parse_trace_line
from unicache.sim.vllm_replay import VllmReplay, VllmServerModel
from unicache.sim.workload import WorkloadConfig, generate

BS = 16


def prepared(rows: list[dict]):
    return prepare([parse_trace_line(json.dumps(r), "t", i + 1, i) for i, r in enumerate(rows)], BS)


def hits(trace, policy: str, usable_blocks: int, **kwargs) -> tuple[int, int]:
    r = VllmReplay(trace, policy, VllmServerModel(num_gpu_blocks=usable_blocks + 1), kwargs).run()
    return r.hit_tokens, r.query_tokens


def recency_trace(n: int = 3000, distance: int = 6, blocks: int = 4) -> list[dict]:
    """Every prompt is new (a novel prefix: UniCache's evict-first rule empties those first)
    and comes back once, ``distance`` new prompts later, never again: what was hit is dead,
    what is new is about to be reused. Recency keeps the right blocks; the class order
    keeps the dead ones."""
    ids = iter(range(10**7))
    prompts, rows = [], []
    for i in range(n):
        prompts.append([next(ids) for _ in range(blocks)])
        rows.append(prompts[-1])
        if i >= distance:
            rows.append(prompts[i - distance])
    return [{"timestamp": 100 * i, "hash_ids": p, "input_length": len(p) * BS, "output_length": 2, "task": "qa"}
            for i, p in enumerate(rows)]


@pytest.mark.parametrize("usable, lru, unicache, unguarded", [
    (60, 143712, 143088, 432),
    (100, 143712, 143120, 912),
])
def test_where_recency_wins_unicache_ties_lru(usable, lru, unicache, unguarded):
    trace = prepared(recency_trace())
    got = {"lru": hits(trace, "lru", usable), "unicache": hits(trace, "unicache", usable),
           "unguarded": hits(trace, "unicache", usable, recency_guard=False)}
    queries = got["lru"][1]
    assert {k: v[0] for k, v in got.items()} == {"lru": lru, "unicache": unicache, "unguarded": unguarded}
    # The class order alone loses nearly everything; guarded, UniCache ends within 0.3
    # points of LRU (the rest is the few windows before the guard sees the loss).
    assert (lru - unguarded) / queries > 0.35
    assert 0 <= (lru - unicache) / queries < 0.003


def spiky_trace(n: int = 4000, p: float = 0.15, blocks: int = 20, seed: int = 1) -> list[dict]:
    """Like ``recency_trace`` but sparse: one new prompt in seven (10-20 blocks) comes back
    once, 5-30 prompts later. The evidence comes in rare whole-prompt spikes, so the guard
    must remember hundreds of requests to tell it from noise."""
    rng = random.Random(seed)
    ids = iter(range(10**7))
    rows, pending = [], []
    for i in range(n):
        prompt = [next(ids) for _ in range(rng.randint(blocks // 2, blocks))]
        rows.append(prompt)
        if rng.random() < p:
            pending.append((i + rng.randint(5, 30), prompt))
        rows += [q for due, q in pending if due <= i]
        pending = [(due, q) for due, q in pending if due > i]
    return [{"timestamp": 100 * i, "hash_ids": q, "input_length": len(q) * BS, "output_length": 2, "task": "qa"}
            for i, q in enumerate(rows)]


def test_sparse_evidence_still_moves_the_guard():
    trace = prepared(spiky_trace())
    lru, unicache = hits(trace, "lru", 200), hits(trace, "unicache", 200)
    unguarded = hits(trace, "unicache", 200, recency_guard=False)
    assert (lru[0], unicache[0], unguarded[0]) == (28800, 26336, 352)
    assert 0 <= (lru[0] - unicache[0]) / lru[1] < 0.003


def test_where_classes_matter_the_guard_keeps_the_wins():
    trace = prepared(generate(WorkloadConfig(seed=0, duration=150)))
    uniq = len({h for r in trace.requests for h in r.prompt_hashes[: r.input_length // BS]})
    got = [(hits(trace, "lru", int(f * uniq))[0], hits(trace, "unicache", int(f * uniq))[0]) for f in (0.05, 0.1)]
    assert got == [(36576, 70304), (60448, 98912)]  # the same as with recency_guard=False
    assert all(u >= 1.1 * lru for lru, u in got)


def test_shadow_counts_a_hit_only_through_an_unbroken_prefix():
    g = RecencyGuard()
    g.on_cached(b"a", None, 1)
    g.on_cached(b"e", b"a", 2)
    g.on_released([b"e", b"a"])
    g.on_hit(b"a", None)  # the shadow has a: a hit for both
    g.on_hit(b"e", b"a")
    assert (g.lookups, g.shadow_hits, g.hits) == (4, 2, 2)
    # The shadow drops a (oldest) and keeps e; the cache drops both. A request for a, e:
    # a misses in the shadow, so e, which it still has, is no hit either.
    g.on_released([b"a", b"e"])
    for h in (b"f", b"g"):
        g.on_cached(h, None, 2)
    assert list(g._shadow) == [b"f", b"g"]
    g.capacity = 4
    g.on_released([b"e", b"f", b"g"])
    g.on_cached(b"h", None, 4)
    g.on_uncached(b"a")
    g.on_uncached(b"e")
    g.on_cached(b"a", None, 5)
    g.on_cached(b"e", b"a", 5)
    assert (g.shadow_hits, g.hits) == (2, 2)
    assert list(g._shadow) == [b"f", b"g", b"h", b"a", b"e"]
    # A second copy of a cached hash (vLLM recomputing a fully cached prompt's last block)
    # is no lookup.
    n = g.lookups
    g.on_cached(b"h", None, 6)
    assert g.lookups == n


def test_shadow_is_bounded_by_the_most_blocks_cached():
    g = RecencyGuard()
    for i in range(10):
        g.on_cached(bytes([i]), None, 3)
    assert g.capacity == 3 and len(g._shadow) == 3
    g.on_hit(bytes([0]), None)  # evicted from the shadow long ago
    assert g.shadow_hits == 0


def test_lru_share_follows_the_windows_and_spreads_victims():
    g = RecencyGuard(step=0.5, margin=0.01, min_lookups=10, decay=0.0, window=1, z=2.0)

    def window(lookups: int, diffs: list[int]) -> None:
        g.lookups = lookups
        for d in diffs:
            g._diff = d
            g.on_request()  # each request's d is folded; window=1 ends a window each time

    window(100, [3])  # one request: 3 > 0.01 * 100 but not > 2 * sqrt(9): noise
    assert g.lru_share == 0.0
    g.lookups, g.diff_sum, g.diff_sq = 100, 15.0, 45.0  # five requests of +3: 15 > 2 * sqrt(45)
    g.end_window()
    assert g.lru_share == 0.5
    assert [g.take_lru() for _ in range(4)] == [False, True, False, True]
    g.lookups, g.diff_sum, g.diff_sq = 100, -15.0, 45.0  # UniCache ahead: back down
    g.end_window()
    assert g.lru_share == 0.0 and not any(g.take_lru() for _ in range(5))
    g.lru_share = 1.0
    g.lookups, g.diff_sum, g.diff_sq = 100, 0.0, 0.0  # a tie: a slow drift back
    g.end_window()
    assert g.lru_share == 1.0 - 0.5 / 512
    g.lookups, g.diff_sum, g.diff_sq = 5, 50.0, 50.0  # too few lookups: no move
    g.end_window()
    assert g.lru_share == 1.0 - 0.5 / 512
    with pytest.raises(ValueError):
        RecencyGuard(step=0)
