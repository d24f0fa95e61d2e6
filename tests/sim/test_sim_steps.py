"""The step service model (``unicache.sim.steps``): exact TTFTs, chunking, decode
interference, admission by blocks, routing through it."""

from __future__ import annotations

import pytest

from unicache.sim.prepare import prepare
from unicache.sim.replay import ReplayConfig
from unicache.sim.steps import StepReplay, unloaded_ttft_s
from unicache.sim.timing import TimingModel
from unicache.sim.trace import TraceRequest

BS = 4
# prefill = 0.125 s per uncached token on one lane, decode step = 0.5 s
LINEAR = TimingModel(prefill_coef=0.125, batch_exp=1.0, token_exp=1.0, decode_s_per_token=0.5)


def req(t_s: float, hash_ids, output=0, input_length=None) -> TraceRequest:
    return TraceRequest(index=0, timestamp_ms=t_s * 1000.0, output_length=output, hash_ids=list(hash_ids),
                        input_length=input_length if input_length is not None else len(hash_ids) * BS)


def run(trace, capacity=64, lanes=1, **kw):
    cfg_kw = {k: kw.pop(k) for k in ("replicas", "router", "pooled", "index_flush_s") if k in kw}
    sim = StepReplay(prepare(trace, BS), ReplayConfig("lru", capacity, lanes=lanes, timing=LINEAR, **cfg_kw), **kw)
    return sim.run(), sim


def test_a_prefill_then_decode_steps():
    res, sim = run([req(0, [1, 2], output=2)])
    assert res["ttft_mean_s"] == pytest.approx(1.0)  # 8 tokens x 0.125 s
    assert res["rejected"] == 0 and sim.replicas[0].running == 0 and sim.replicas[0].store.num_free_blocks == 64


def test_the_budget_chunks_a_prompt_across_steps():
    res, _ = run([req(0, [1, 2, 3])], step_token_budget=4)  # 12 tokens: chunks 4, 4, 4 of 0.5 s
    assert res["ttft_mean_s"] == pytest.approx(1.5)


def test_a_new_prompt_waits_for_the_running_step_then_shares_one_with_decodes():
    # r1: 8 tokens [0, 1.0], then decodes of 0.5 s; r2 arrives at 1.2 during the step
    # [1.0, 1.5], joins [1.5, 2.0] beside r1's decode (max(0.5, 4 x 0.125) = 0.5)
    _, sim = run([req(0, [1, 2], output=4), req(1.2, [9])])
    assert [round(x, 9) for x in sim.counters.ttfts] == [1.0, 0.8]


class Recording(StepReplay):
    """Records (request id, time) of every finish."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.finished: list[tuple[str, float]] = []
        self._t = 0.0

    def _prefill_done(self, rep, chunks, t):
        self._t = t
        super()._prefill_done(rep, chunks, t)

    def _done(self, rep, r):
        self.finished.append((r.rid, round(self._t, 9)))
        super()._done(rep, r)


def test_a_long_prefill_slows_the_decodes_it_shares_a_step_with():
    # r1 (4 tokens, 4 output) decodes from t = 0.5; r2 (16 tokens: 2 s of prefill) arrives
    # at 0.6. Steps: [0, .5] r1's prefill; [.5, 1] decode 1; [1, 3] decode 2 beside r2's
    # whole prompt; [3, 3.5] decode 3; [3.5, 4] decode 4. On the lanes model r1 would end
    # at 2.5 whatever else ran.
    sim = Recording(prepare([req(0, [1], output=4), req(0.6, [5, 6, 7, 8])], BS),
                    ReplayConfig("lru", 64, lanes=1, timing=LINEAR))
    res = sim.run()
    assert sim.finished == [("1", 3.0), ("0", 4.0)]
    assert res["ttft_p99_s"] == pytest.approx(3.0 - 0.6)


def test_admission_waits_for_blocks_and_rejects_what_never_fits():
    # capacity 3 blocks: r1 holds 2 (+1 output block room) until it finishes; r2 needs 2
    res, _ = run([req(0, [1, 2], output=1), req(0.1, [5, 6]), req(0.2, [7, 8, 9, 10, 11])], capacity=3)
    assert res["rejected"] == 1
    # r1: prefill [0, 1.0], decode [1.0, 1.5] -> frees; r2 admitted at 1.5: TTFT 2.5 - 0.1
    assert res["ttft_p99_s"] == pytest.approx(2.4)


def test_routes_and_pools_through_the_same_policies():
    trace = [req(i * 0.3, [1, 2, 3, 50 + i], output=2) for i in range(8)]
    res, sim = run(trace, replicas=2, router="cache_aware")
    assert res["router"] == "cache_aware" and res["rejected"] == 0
    assert sum(r.computed_prefill_tokens for r in sim.replicas) < 8 * 16  # the shared prefix hit
    lagged, _ = run(trace, replicas=2, router="cache_aware", index_flush_s=0.25)  # the lagging index works here too
    assert lagged["index_flush_s"] == 0.25 and lagged["rejected"] == 0
    pooled, psim = run(trace, replicas=2, pooled=True)
    assert len(psim.replicas) == 1 and psim.step_token_budget == 2 * 8192 and pooled["rejected"] == 0


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="no host tier"):
        StepReplay(prepare([req(0, [1])], BS), ReplayConfig("lru", 4, host_capacity_blocks=4))
    with pytest.raises(ValueError, match="must be positive"):
        StepReplay(prepare([req(0, [1])], BS), ReplayConfig("lru", 4), step_token_budget=0)


def test_unloaded_ttft_matches_a_lone_replay():
    for n_blocks, budget in ((2, 8192), (3, 4), (5, 8)):
        trace = [req(0, list(range(1, n_blocks + 1)))]
        res, _ = run(trace, lanes=2, step_token_budget=budget)
        assert res["ttft_mean_s"] == pytest.approx(unloaded_ttft_s(LINEAR, n_blocks * BS, lanes=2, step_token_budget=budget))


def test_light_load_ttft_waits_for_the_step_in_flight_and_rides_decode_steps():
    # 8 tokens = 1.0 s of prefill on one lane, decode steps 0.5 s: 0.5 + max(0.5, 1.0)
    assert unloaded_ttft_s(LINEAR, 8, lanes=1, decoding=True) == pytest.approx(1.5)
    # 2 tokens = 0.25 s: each step lasts a decode step: 0.5 + 0.5
    assert unloaded_ttft_s(LINEAR, 2, lanes=1, decoding=True) == pytest.approx(1.0)
