"""Exact scheduling: admission, block growth, preemption of the newest, recompute with hits."""

from __future__ import annotations

import pytest

from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.engine import LLMEngine
from tests.support.engine_factory import make_request, run_one, tiny_config


def snapshot(eng: LLMEngine):
    s = eng.scheduler
    running = [(q.seq_id, len(q.token_ids), eng.store.block_table(q.seq_id)) for q in s.running]
    return running, [q.seq_id for q in s.waiting], s.num_preemptions, eng.store.stats.evictions


def test_newest_request_is_preempted_and_recomputed_from_its_cached_blocks():
    # 8 blocks of 4 tokens; two 8-token prompts that each grow to 20 tokens cannot both fit.
    eng = LLMEngine(tiny_config(num_blocks=8))
    a, b = list(range(8)), list(range(100, 108))
    eng.add_request(make_request("A", a, max_tokens=12))
    eng.add_request(make_request("B", b, max_tokens=12))
    tokens: dict[str, list[int]] = {"A": [], "B": []}
    states = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        states.append(snapshot(eng))
    assert states[0] == ([("A#0", 9, [0, 1]), ("B#0", 9, [2, 3])], [], 0, 0)
    assert states[5] == ([("A#0", 14, [0, 1, 4, 6]), ("B#0", 14, [2, 3, 5, 7])], [], 0, 0)
    # Position 16 needs a fifth block for A: B (newest) is preempted; A evicts B's tail
    # block 7 (LRU frees a request's tail first) and keeps going.
    assert states[9] == ([("A#0", 18, [0, 1, 4, 6, 7])], ["B#0"], 1, 1)
    assert states[11] == ([], ["B#0"], 1, 1)  # A finished at 20 tokens: blocks free
    # B comes back hitting its 3 surviving blocks, recomputes the rest in one step.
    assert states[12] == ([("B#0", 18, [2, 3, 5, 7, 6])], [], 1, 2)
    assert len(states) == 15
    for rid, prompt in (("A", a), ("B", b)):
        cold = LLMEngine(tiny_config(enable_prefix_caching=False))
        assert tokens[rid] == run_one(cold, make_request(rid, prompt, max_tokens=12)).tokens[0]
    assert eng.num_referenced_blocks() == 0


def test_admission_respects_max_num_seqs_counting_every_sample():
    eng = LLMEngine(tiny_config(max_num_seqs=4))
    eng.add_request(make_request("A", list(range(6)), max_tokens=3, n=3))
    eng.add_request(make_request("B", list(range(6, 12)), max_tokens=3, n=2))
    eng.step()
    running, waiting, _, _ = snapshot(eng)
    assert [r[0] for r in running] == ["A#0", "A#1", "A#2"] and waiting == ["B#0"]
    while eng.has_unfinished():
        eng.step()
    assert eng.num_referenced_blocks() == 0


def test_prefill_is_chunked_by_the_token_budget():
    eng = LLMEngine(tiny_config(max_num_batched_tokens=8))
    eng.add_request(make_request("A", list(range(20)), max_tokens=2))
    computed = []
    while eng.has_unfinished():
        eng.step()
        computed += [q.num_computed for q in eng.scheduler.running]
    assert computed[:3] == [8, 16, 20]


def test_published_queue_holds_whole_prompts_until_the_first_token():
    # A's 20-token prompt is prefilled in 8-token chunks: it stays in the queue, whole,
    # until the step that computes its last chunk; B waits behind max_num_seqs=1.
    eng = LLMEngine(tiny_config(max_num_seqs=1, max_num_batched_tokens=8))
    eng.add_request(make_request("A", list(range(20)), max_tokens=2))
    eng.add_request(make_request("B", list(range(50, 56)), max_tokens=1))
    queued = [eng.load().queued_prefill_tokens]
    while eng.has_unfinished():
        eng.step()
        queued.append(eng.load().queued_prefill_tokens)
    # before; after chunks 1 and 2 (A 8, 16 of 20); A's first token; A done; B done
    assert queued == [26, 26, 26, 6, 6, 0]


def test_engine_config_rejects_nonsense():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        EngineConfig(num_gpu_blocks=0)
    assert EngineConfig(num_blocks=8, num_gpu_blocks=32).total_blocks == 32


def test_usage_times_come_from_the_engine_clock():
    # A waits 2 s and is prefilled in three 8-token chunks (one step each); B, held back
    # by max_num_seqs=1, is scheduled only once A has finished.
    now = [10.0]
    eng = LLMEngine(tiny_config(max_num_seqs=1, max_num_batched_tokens=8), clock=lambda: now[0])
    eng.add_request(make_request("A", list(range(20)), max_tokens=1))
    eng.add_request(make_request("B", list(range(50, 54)), max_tokens=1))
    usage = {}
    for t in (12.0, 13.0, 14.5, 20.0):
        now[0] = t
        for out in eng.step():
            if out.finished:
                usage[out.request_id] = (out.usage.queue_time_s, out.usage.prefill_time_s)
    assert usage == {"A": (2.0, 2.5), "B": (10.0, 0.0)}
    assert not eng.has_unfinished()


def test_usage_of_a_request_aborted_before_scheduling_reads_the_engine_clock():
    # Aborted while still waiting: its whole life (arrival 10 s to abort 17 s) is queue
    # time by the engine's clock, whatever time.monotonic() says.
    now = [10.0]
    eng = LLMEngine(tiny_config(max_num_seqs=1, max_num_batched_tokens=8), clock=lambda: now[0])
    eng.add_request(make_request("A", list(range(20)), max_tokens=1))
    now[0] = 17.0
    (out,) = eng.abort("A")
    assert (out.finish_reason, out.usage.queue_time_s, out.usage.prefill_time_s) == ("abort", 7.0, 0.0)
