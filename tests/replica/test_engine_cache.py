"""Prefix-cache hits never change what the engine generates; blocks are never leaked.

Every scenario runs on a warm engine and compares with the same request on a cold one
(prefix caching disabled), and ends by checking that no block is referenced and the
store's invariants hold.
"""

from __future__ import annotations

import pytest
import torch

from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.sampling import make_generator, sample
from tests.support.engine_factory import drain, make_request, run_one, tiny_config

BS = 4


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 17) % 256 for i in range(n)]


def cold(req):
    return run_one(LLMEngine(tiny_config(enable_prefix_caching=False)), req)


def assert_idle(engine: LLMEngine) -> None:
    assert engine.num_referenced_blocks() == 0
    engine.check_invariants()


def test_multi_turn_continuation_hits_prompt_and_decode_blocks():
    eng = LLMEngine(tiny_config())
    turn1 = prompt(1, 37)
    r1 = run_one(eng, make_request("t1", turn1, max_tokens=10))
    turn2 = turn1 + r1.tokens[0] + prompt(2, 6)
    r2 = run_one(eng, make_request("t2", turn2, max_tokens=10))
    # Turn 1 computed 37 prompt + 9 decode tokens = 11 full blocks (44 tokens).
    assert r2.last[0].usage.cached_tokens == 44
    assert r1.last[0].usage.cached_tokens == 0
    assert r2.tokens == cold(make_request("t2", turn2, max_tokens=10)).tokens
    assert_idle(eng)


def test_shared_template_is_reused_across_requests():
    eng = LLMEngine(tiny_config())
    template = prompt(3, 32)
    a = run_one(eng, make_request("a", template + prompt(4, 5)))
    b = run_one(eng, make_request("b", template + prompt(5, 7)))
    assert a.last[0].usage.cached_tokens == 0
    assert b.last[0].usage.cached_tokens == 32
    assert b.tokens == cold(make_request("b", template + prompt(5, 7))).tokens
    assert_idle(eng)


def test_block_aligned_prompt_still_computes_its_last_token():
    eng = LLMEngine(tiny_config())
    p = prompt(6, 16)  # exactly 4 blocks
    run_one(eng, make_request("a", p))
    again = run_one(eng, make_request("b", p))
    # At most floor((16 - 1) / 4) = 3 blocks may hit: the last token's logits are needed.
    assert again.last[0].usage.cached_tokens == 12
    assert again.tokens == cold(make_request("b", p)).tokens
    assert_idle(eng)


def test_cache_salt_separates_tenants():
    eng = LLMEngine(tiny_config())
    p = prompt(7, 20)
    run_one(eng, make_request("a", p))
    other = make_request("b", p)
    other.cache_salt = b"tenant-b"
    assert run_one(eng, other).last[0].usage.cached_tokens == 0
    same = make_request("c", p)
    assert run_one(eng, same).last[0].usage.cached_tokens == 16
    assert_idle(eng)


def _replay_dense(engine: LLMEngine, req, index: int, tokens: list[int]) -> list[int]:
    """Re-sample sample ``index`` token by token from full, uncached forwards."""
    gen = make_generator(req.sampling, index, 0)
    seq = list(req.prompt_token_ids)
    out = []
    for _ in tokens:
        logits = engine.model.forward_dense(torch.tensor(seq))[-1]
        tok = sample(logits, req.sampling, gen)
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize("prompt_len", [18, 20])  # partial last block (copy-on-write) / aligned
def test_fork_samples_match_uncached_replays(prompt_len, monkeypatch):
    eng = LLMEngine(tiny_config())
    copies = []
    real_copy = eng.storage.copy_block
    monkeypatch.setattr(eng.storage, "copy_block", lambda s, d: (copies.append((s, d)), real_copy(s, d)))
    p = prompt(8, prompt_len)
    run_one(eng, make_request("warm", p, max_tokens=2))
    req = make_request("fork", p, max_tokens=9, n=3, temperature=1.0, seed=1234)
    res = run_one(eng, req)
    assert sorted(res.tokens) == [0, 1, 2]
    assert res.last[0].usage.cached_tokens == (prompt_len - 1) // BS * BS
    for i in range(3):
        assert res.tokens[i] == _replay_dense(eng, req, i, res.tokens[i])
    assert len({tuple(t) for t in res.tokens.values()}) == 3  # distinct seeds, distinct samples
    # A partial last prompt block shared by 3 samples is copied for the first two writers.
    assert len(copies) == (2 if prompt_len % BS else 0)
    assert_idle(eng)


def test_greedy_fork_samples_equal_a_single_sample():
    eng = LLMEngine(tiny_config())
    p = prompt(9, 14)
    res = run_one(eng, make_request("f", p, max_tokens=7, n=4))
    single = cold(make_request("s", p, max_tokens=7))
    assert res.tokens == {i: single.tokens[0] for i in range(4)}
    assert_idle(eng)


def test_hits_after_evictions_generate_the_cold_tokens():
    eng = LLMEngine(tiny_config(num_blocks=24))
    p = prompt(10, 40)
    first = run_one(eng, make_request("a", p, max_tokens=4))
    assert eng.cache_state().cached_blocks == 10
    # 16 blocks needed, 14 uncached free: LRU evicts p's two tail blocks (tail first).
    run_one(eng, make_request("x", prompt(20, 60), max_tokens=4))
    assert eng.cache_state().evictions == 2
    again = run_one(eng, make_request("b", p, max_tokens=4))
    assert again.last[0].usage.cached_tokens == 32
    assert again.tokens == first.tokens == cold(make_request("c", p, max_tokens=4)).tokens
    assert_idle(eng)


def test_preempted_requests_recompute_and_generate_the_cold_tokens():
    eng = LLMEngine(tiny_config(num_blocks=20, max_num_seqs=8))
    reqs = [make_request(f"r{i}", prompt(30 + i, 10), max_tokens=20) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    results = drain(eng)
    assert eng.scheduler.num_preemptions > 0
    for r in reqs:
        want = cold(make_request(r.request_id, r.prompt_token_ids, max_tokens=20))
        assert results[r.request_id].tokens == want.tokens
        assert results[r.request_id].last[0].usage.completion_tokens == 20
    assert_idle(eng)


def test_chunked_prefill_generates_the_same_tokens():
    eng = LLMEngine(tiny_config(max_num_batched_tokens=8))
    p = prompt(11, 45)
    assert run_one(eng, make_request("a", p)).tokens == cold(make_request("a", p)).tokens
    assert_idle(eng)


def test_aborted_and_failed_requests_free_their_blocks(monkeypatch):
    eng = LLMEngine(tiny_config())
    eng.add_request(make_request("a", prompt(12, 30), max_tokens=50))
    eng.add_request(make_request("b", prompt(13, 9), max_tokens=50, n=2))
    for _ in range(4):
        eng.step()
    assert eng.num_referenced_blocks() > 0
    outs = eng.abort("b")
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert eng.abort("b") == []

    def boom(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng, "_forward", boom)
    with pytest.raises(RuntimeError):
        eng.step()
    assert eng.fail_all(RuntimeError("x")) == ["a"]
    assert not eng.has_unfinished()
    assert_idle(eng)
