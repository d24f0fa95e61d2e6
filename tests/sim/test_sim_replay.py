"""The replay engine: exact hits, TTFTs, queueing, pinning, rejection, opt, routing."""

from __future__ import annotations

import math

import pytest

from unicache.contract.request_class import Task
from unicache.sim.metrics import percentile
from unicache.sim.prepare import future_accesses, prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.timing import TimingModel
from unicache.sim.trace import TraceRequest

BS = 4
# prefill = 0.125 s per uncached token (batch of one), decode = 0.5 s per token
LINEAR = TimingModel(prefill_coef=0.125, batch_exp=1.0, token_exp=1.0, decode_s_per_token=0.5)


def req(t_s: float, hash_ids, input_length=None, output=0, out_ids=(), **labels) -> TraceRequest:
    return TraceRequest(
        index=0,
        timestamp_ms=t_s * 1000.0,
        input_length=input_length if input_length is not None else len(hash_ids) * BS,
        output_length=output,
        hash_ids=list(hash_ids),
        output_hash_ids=list(out_ids),
        **labels,
    )


def run(trace, policy="lru", capacity=64, **kw):
    prepared = prepare(trace, BS)
    future = future_accesses(prepared)
    cfg = ReplayConfig(policy=policy, capacity_blocks=capacity, timing=kw.pop("timing", LINEAR), **kw)
    sim = Replay(prepared, cfg, future=future)
    return sim.run(), sim


def test_timing_model_defaults_and_batch():
    t = TimingModel()
    assert t.prefill_s(1, 1000) == pytest.approx(5.56e-5 * 1000**1.034)
    assert t.prefill_s(2, 2000) == pytest.approx(5.56e-5 * 2**0.992 * 1000**1.034)
    assert t.prefill_s(1, 0) == pytest.approx(5.56e-5)  # a full hit still computes one token
    assert t.prefill_s(0, 0) == 0.0
    assert t.decode_s(10) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        TimingModel(prefill_coef=-1)


def test_prefix_hit_ttft_and_ratios():
    res, _ = run([req(0, [1, 2]), req(10, [1, 2, 3])])
    assert res["block_hit_ratio"] == pytest.approx(2 / 5)
    assert res["token_hit_ratio"] == pytest.approx(8 / 20)
    assert res["hit_blocks"] == 2
    assert res["ttft_mean_s"] == pytest.approx((1.0 + 0.5) / 2)  # 8 then 4 uncached tokens
    assert res["ttft_p99_s"] == pytest.approx(1.0)
    assert res["evictions"] == 0 and res["rejected"] == 0


@pytest.mark.parametrize("lanes, hits, ttft1", [(1, 2, 0.5 + 0.5), (2, 0, 1.5)])
def test_overlapping_requests_queue_or_miss(lanes, hits, ttft1):
    """One lane: the second request waits for the first prefill and then hits its blocks.
    Two lanes: it starts at once, before the first one's blocks are cached, and misses."""
    res, sim = run([req(0, [1, 2]), req(0.5, [1, 2, 3])], lanes=lanes)
    assert res["hit_blocks"] == hits
    assert sorted(sim.counters.ttfts) == pytest.approx(sorted([1.0, ttft1]))


def test_host_tier_promotion_costs_its_copy_in_ttft():
    """GPU of 2 blocks, host of 4. [3, 4] demotes [1, 2]; [1, 2] again promotes block 1
    (its last block holds the last token, always computed): its TTFT is 4 computed
    tokens (0.5 s) plus 1 block * 4 tokens * 1 byte at 16 B/s (0.25 s), instead of
    recomputing 8 tokens (1.0 s)."""
    timing = TimingModel(prefill_coef=0.125, batch_exp=1.0, token_exp=1.0, decode_s_per_token=0.5,
                         h2d_bytes_per_s=16.0, kv_bytes_per_token=1)
    assert timing.promote_s(2, BS) == pytest.approx(0.5)
    trace = [req(0, [1, 2]), req(10, [3, 4]), req(20, [1, 2])]
    res, sim = run(trace, capacity=2, timing=timing, host_capacity_blocks=4, host_policy="lru")
    assert sim.counters.ttfts == pytest.approx([1.0, 1.0, 0.75])
    assert (res["hit_blocks"], res["host_hit_blocks"], res["demotions"], res["evictions"]) == (1, 1, 4, 4)
    assert (res["gpu_hit_ratio"], res["host_hit_ratio"], res["block_hit_ratio"]) == pytest.approx((0, 1 / 6, 1 / 6))
    assert (res["host_capacity_blocks"], res["host_policy"]) == (4, "lru")
    single, _ = run(trace, capacity=2, timing=timing)
    assert (single["hit_blocks"], single["host_hit_blocks"], single["host_policy"]) == (0, 0, None)
    assert single["ttft_mean_s"] == pytest.approx(1.0)
    sim.replicas[0].store.check_invariants()


def test_running_blocks_are_pinned_and_requests_wait_for_blocks():
    # r0 reserves 3 blocks (2 prompt + 1 for 4 output tokens): prefill ends at 1.0,
    # decode at 1.0 + 4 * 0.5 = 3.0. r1 needs one block: it waits until 3.0.
    trace = [req(0, [1, 2], output=4), req(0.1, [5]), req(10, [1, 2, 6])]
    res, sim = run(trace, capacity=3)
    assert sim.counters.ttfts == pytest.approx([1.0, 3.0 - 0.1 + 0.5, 0.5])
    # r1 took the uncached decode block, so r0's prompt blocks survived for r2
    assert res["hit_blocks"] == 2
    assert res["evictions"] == 1  # r2's third block evicts r1's block
    sim.replicas[0].store.check_invariants()


def test_request_larger_than_the_replica_is_rejected():
    res, sim = run([req(0, [1, 2, 3]), req(1, [1])], capacity=2)
    assert res["rejected"] == 1
    assert res["hit_blocks"] == 0
    assert res["block_hit_ratio"] == 0.0
    assert len(sim.counters.ttfts) == 1


def test_decode_blocks_are_hit_by_the_next_turn():
    trace = [
        req(0, [1, 2], output=8, out_ids=[7, 8], session_id="s", turn=0, task=Task.CHAT),
        req(20, [1, 2, 7, 8, 9], session_id="s", turn=1, task=Task.CHAT),
    ]
    res, _ = run(trace)
    assert res["hit_blocks"] == 4
    assert res["per_task"] == {"chat": pytest.approx(4 / 7)}


def test_tenant_salt_keeps_tenants_apart():
    res, _ = run([req(0, [1, 2], tenant="a"), req(5, [1, 2], tenant="b"), req(10, [1, 2], tenant="a")])
    assert res["hit_blocks"] == 1  # the third hits a's first block; its last block is computed


SEQ = [1, 2, 3, 1, 2]


@pytest.mark.parametrize("policy, hits, evictions", [("lru", 0, 7), ("radix-lru", 0, 7), ("opt", 1, 6)])
def test_opt_uses_the_future_through_the_same_replay(policy, hits, evictions):
    # one full block (the id in SEQ), then one token of a block no request shares: only
    # the full block can be a hit
    trace = [req(10 * i, [first, 100 + i], input_length=BS + 1) for i, first in enumerate(SEQ)]
    res, sim = run(trace, policy=policy, capacity=3)
    assert res["hit_blocks"] == hits
    assert res["evictions"] == evictions
    sim.replicas[0].store.check_invariants()


def test_opt_never_below_lru_on_a_mixed_trace():
    trace = [req(i, [i % 3, 100 + i % 5, 200 + i]) for i in range(40)]
    lru, _ = run(trace, capacity=8)
    opt, _ = run(trace, policy="opt", capacity=8)
    assert opt["hit_blocks"] > lru["hit_blocks"]


def test_two_replicas_round_robin_and_pooled():
    trace = [req(0, [1, 2]), req(5, [1, 2]), req(10, [1, 2])]
    res, sim = run(trace, replicas=2, router="round_robin")
    assert res["hit_blocks"] == 1  # r0, r1 (miss), r0 (hit: the first block; the last is computed)
    assert (res["router"], res["replicas"]) == ("round_robin", 2)
    assert [r.computed_prefill_tokens for r in sim.replicas] == [12, 8]
    assert res["load_imbalance"] == pytest.approx(12 / 10)
    # the locality index saw r0's and r1's stored blocks through their events
    hashes = sim.trace.requests[0].prompt_hashes
    assert sim.index.match("r0", hashes) == 2 and sim.index.match("r1", hashes) == 2
    pooled, psim = run(trace, replicas=2, pooled=True)
    assert pooled["hit_blocks"] == 2 and pooled["router"] == "pooled"
    assert len(psim.replicas) == 1 and psim.replicas[0].store.num_blocks == 128


def test_load_imbalance_counts_computed_prefill_tokens():
    trace = [req(0, [1, 2, 3, 4]), req(1, [9])]
    res, sim = run(trace, replicas=2, router="round_robin")
    assert [r.computed_prefill_tokens for r in sim.replicas] == [16, 4]
    assert res["load_imbalance"] == pytest.approx(16 / 10)


def test_published_queue_holds_a_prompt_until_its_prefill_is_done():
    """A replica publishes the whole prompt of every request without its first token,
    waiting or being prefilled, as the vLLM engine does: the router sees a busy lane."""
    trace = [req(0, [1, 2, 3, 4]), req(1, [9]), req(3, [5])]  # prefills: 16 tokens = 2 s, then 0.5 s
    seen = []

    class Watching(Replay):
        def _snapshot(self):
            loads = super()._snapshot()
            seen.append([(r.replica_id, r.queued_prefill_tokens, r.running, r.waiting) for r in loads])
            return loads

    prepared = prepare(trace, BS)
    sim = Watching(prepared, ReplayConfig("lru", 64, replicas=2, router="round_robin", lanes=1, timing=LINEAR))
    sim.run()
    # t = 0: nothing yet; t = 1: r0 prefills 16 tokens until t = 2; t = 3: both done
    assert seen == [[("r0", 0, 0, 0), ("r1", 0, 0, 0)],
                    [("r0", 16, 1, 0), ("r1", 0, 0, 0)],
                    [("r0", 0, 0, 0), ("r1", 0, 0, 0)]]


@pytest.mark.parametrize("flush_s, seen_at", [
    (0.0, [(0.0, 0, 0), (2.5, 4, 0), (5.0, 4, 1)]),  # the index never lags
    (4.0, [(0.0, 0, 0), (2.5, 0, 0), (5.0, 4, 0)]),  # r0 flushes at 4, 8, ...; r1 at 2, 6, ...
])
def test_index_sees_store_events_at_the_replicas_next_flush(flush_s, seen_at):
    """r0 caches four blocks at t = 2 (its prefill's end), r1 one at t = 3: with a 4 s
    publishing period the router's index learns of r0's at r0's flush at t = 4 and of
    r1's at r1's flush at t = 6, after the last arrival."""
    trace = [req(0, [1, 2, 3, 4]), req(2.5, [7]), req(5, [8])]
    seen = []

    class Watching(Replay):
        def _snapshot(self):
            loads = super()._snapshot()
            seen.append((self._now, self.index.num_blocks("r0"), self.index.num_blocks("r1")))
            return loads

    prepared = prepare(trace, BS)
    sim = Watching(prepared, ReplayConfig("lru", 64, replicas=2, router="round_robin", lanes=1, timing=LINEAR,
                                          index_flush_s=flush_s))
    sim.run()
    assert [r.flush_phase_s for r in sim.replicas] == [0.0, flush_s / 2]
    assert seen == seen_at


def test_config_errors():
    prepared = prepare([req(0, [1])], BS)
    with pytest.raises(ValueError, match="capacity"):
        Replay(prepared, ReplayConfig("lru", 0))
    with pytest.raises(ValueError, match="oracle"):
        Replay(prepared, ReplayConfig("opt", 4))
    with pytest.raises(ValueError, match="router"):
        Replay(prepared, ReplayConfig("lru", 4, replicas=2))
    with pytest.raises(ValueError, match="rate_scale must be positive"):
        Replay(prepared, ReplayConfig("lru", 4, rate_scale=0.0))
    with pytest.raises(ValueError, match="index_flush_s must not be negative"):
        Replay(prepared, ReplayConfig("lru", 4, index_flush_s=-0.1))


def test_percentile_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert math.isnan(percentile([], 99))


def test_hot_path_records_are_slotted():
    from unicache.sim.prepare import SimRequest
    from unicache.sim.replica import SimReplica

    for cls in (SimRequest, SimReplica, TimingModel, ReplayConfig):
        assert hasattr(cls, "__slots__"), cls


def test_label_names_a_variant():
    res, _ = run([req(0, [1])], policy="radix-lru", label="radix-variant")
    assert res["policy"] == "radix-variant"


def test_router_kwargs_build_the_routing_policy():
    prepared = prepare([req(0, [1])], BS)
    sim = Replay(prepared, ReplayConfig("lru", 4, replicas=2, router="cache_aware",
                                        router_kwargs={"footprint_weight": 0.0, "churn_window": 64}))
    assert (sim.router.config.footprint_weight, sim.router._decay) == (0.0, 1 - 1 / 64)
    assert sim.router.ring.members == {"r0", "r1"}
    with pytest.raises(ValueError, match="does not take no_such_knob"):
        Replay(prepared, ReplayConfig("lru", 4, replicas=2, router="cache_aware", router_kwargs={"no_such_knob": 1}))


def test_the_event_pump_hands_the_index_each_blocks_parent():
    from unicache.contract.block_hash import hash_token_blocks
    from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from unicache.router.cluster.index import LocalityIndex
    from unicache.sim.replay import _pump

    a, b, c = hash_token_blocks([1, 2, 3], 1)
    x = hash_token_blocks([9], 1)[0]
    index = LocalityIndex()
    _pump(index, "r", [BlockStored(x, None, 0), BlockStored(a, None, 0), BlockStored(b, a, 0), BlockRemoved(x, 0),
                       BlockStored(c, b, 0)])
    blocks = index.holdings("r").blocks
    assert list(blocks) == [a, b, c]
    assert [blocks[a].parent, blocks[b].parent, blocks[c].parent] == [None, blocks[a], blocks[b]]
    assert [blocks[h].children for h in (a, b, c)] == [1, 1, 0]
    _pump(index, "r", [BlockStored(x, None, 1), AllBlocksCleared(1), BlockStored(a, None, 1)])
    assert list(index.holdings("r").blocks) == [a] and not index.needs_resync("r")
    _pump(index, "fresh", [])
    assert index.has_replica("fresh") and index.num_blocks("fresh") == 0
