"""Exact eviction orders of the lru and unicache policies on small hand-built cases."""

from __future__ import annotations

import math

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.replica.eviction.base import ReleaseInfo
from unicache.replica.eviction.lognormal import OnlineLogNormal
from unicache.replica.eviction.registry import make_policy
from unicache.replica.eviction.unicache import (
    AGENT,
    CHAT,
    EVICT_FIRST,
    NOVEL_LANE,
    NUM_LANES,
    STRUCTURAL,
    TAIL_LANE,
    UniCachePolicy,
)
from tests.support.unicache_variants import AblationUniCache

SINGLE = RequestClass()
CHAT_CLS = RequestClass(session_id="c", turn=1, task=Task.CHAT)
AGENT_CLS = RequestClass(session_id="a", turn=1, task=Task.AGENT)
TEMPLATE = RequestClass(template=True, template_blocks=2, task=Task.TOOL)


def release(policy, block_ids, cls, now, num_prompt_blocks=None):
    """Release a request's blocks tail first, as the store does."""
    n = len(block_ids)
    prompt = n if num_prompt_blocks is None else num_prompt_blocks
    for pos in range(n - 1, -1, -1):
        policy.on_release(block_ids[pos], ReleaseInfo(cls, pos, n, pos >= prompt, now))


def drain(policy):
    out = []
    while (v := policy.pop_victim()) is not None:
        out.append(v)
    return out


def plain(**kw):
    """unicache with the adaptive parts off, so orders follow from the queue rules alone."""
    base = dict(weighting="none", online_fit=False, horizon_scoring=False, tail_lane=False)
    base.update(kw)
    return AblationUniCache(**base)


# ---------------------------------------------------------------- lru
def test_lru_oldest_request_first_tail_before_head_and_hits_leave():
    p = make_policy("lru")
    release(p, [0, 1, 2], SINGLE, 1.0)
    release(p, [3, 4], SINGLE, 2.0)
    p.on_access(1, SINGLE, 3.0)
    assert drain(p) == [2, 0, 4, 3]
    assert p.pop_victim() is None


# ----------------------------------------------------------- unicache
def test_queue_placement():
    p = UniCachePolicy()
    q = lambda cls, pos, n, dec=False: p.queue_of(ReleaseInfo(cls, pos, n, dec, 0.0))  # noqa: E731
    assert q(SINGLE, 0, 3) == EVICT_FIRST
    assert q(SINGLE, 2, 3, dec=True) == EVICT_FIRST
    assert q(CHAT_CLS, 0, 3) == CHAT
    assert q(CHAT_CLS, 2, 3, dec=True) == CHAT
    assert q(AGENT_CLS, 1, 3) == AGENT
    assert q(TEMPLATE, 0, 4) == STRUCTURAL
    assert q(TEMPLATE, 1, 4) == STRUCTURAL
    assert q(TEMPLATE, 2, 4) == EVICT_FIRST  # the unique suffix after the template
    assert AblationUniCache(split_agent=False).queue_of(ReleaseInfo(AGENT_CLS, 0, 1, False, 0.0)) == CHAT
    assert AblationUniCache(structural=False).queue_of(ReleaseInfo(TEMPLATE, 0, 4, False, 0.0)) == EVICT_FIRST
    assert AblationUniCache(session_queues=False).queue_of(ReleaseInfo(CHAT_CLS, 0, 4, False, 0.0)) == EVICT_FIRST


def test_strict_evict_first_empties_evict_first_before_older_session_blocks():
    p = plain(strict_evict_first=True)
    release(p, [0, 1], CHAT_CLS, 1.0)
    release(p, [2, 3], SINGLE, 5.0)
    assert p.queue_sizes() == {"evict_first": 2, "chat": 2, "agent": 0, "structural": 0}
    assert drain(p) == [3, 2, 1, 0]


def test_equal_weights_and_shared_fit_fall_back_to_global_lru_order():
    p = plain()
    release(p, [0, 1], CHAT_CLS, 1.0)
    release(p, [2, 3], SINGLE, 5.0)
    release(p, [4], CHAT_CLS, 6.0)
    p.on_request(SINGLE, 7.0)
    assert drain(p) == [1, 0, 3, 2, 4]


def test_reuse_weights_evict_never_reused_queue_before_an_older_reused_one():
    def run(weighting):
        p = AblationUniCache(weighting=weighting, online_fit=False, horizon_scoring=False, update_every=1, tail_lane=False)
        release(p, [10], CHAT_CLS, 0.0)
        p.on_access(10, CHAT_CLS, 1.0)  # chat blocks get reused
        release(p, [10], CHAT_CLS, 2.0)
        release(p, [20], SINGLE, 2.5)  # evict-first blocks never are
        p.on_request(SINGLE, 3.0)
        return p, drain(p)

    p, order = run("reuse")
    assert p.weight(CHAT, turn=1) == pytest.approx(1.5 / 3.0)
    assert p.weight(EVICT_FIRST) == pytest.approx(0.1 / 2.0)  # evict-first's prior: 0.1
    assert order == [20, 10]
    assert run("none")[1] == [10, 20]


def test_ghost_reuse_counts_for_the_queue_that_evicted_it():
    p = AblationUniCache(online_fit=False, horizon_scoring=False, update_every=1, tail_lane=False)
    h = hash_id_blocks([1, 2])
    p.on_cached(0, h[0], -1, 0.0)
    p.on_cached(1, h[1], 0, 0.0)
    release(p, [0, 1], SINGLE, 0.0)
    assert drain(p) == [1, 0]
    p.on_cached(5, h[1], -1, 9.0)  # the evicted prefix was needed again: a missed reuse
    p.on_request(SINGLE, 9.0)
    # Cached from the root and never hit, blocks 0 and 1 were a novel prefix: the missed
    # reuse counts for the novel lane (two releases plus the prior's one).
    assert p.alpha[EVICT_FIRST * NUM_LANES + NOVEL_LANE] == pytest.approx(1.1 / 3.0)
    assert p.weight(EVICT_FIRST) == pytest.approx(0.1)


def test_structural_queue_cold_template_before_hot_and_deep_before_shallow():
    p = plain()
    release(p, [0, 1], TEMPLATE, 1.0)  # template X
    release(p, [2, 3], TEMPLATE, 2.0)  # template Y
    p.on_access(0, TEMPLATE, 3.0)
    p.on_access(1, TEMPLATE, 3.0)
    release(p, [0, 1], TEMPLATE, 4.0)  # X is hot again
    assert drain(p) == [3, 2, 1, 0]


def test_structural_rate_frequent_template_outlives_a_more_recent_single_hit():
    # h = 120 s. Block 1: cached at 0, hit at 1, 2, 3, 4 (decayed count ~4.9 at t=4,
    # effective time E = 4 + 120 log2(4.9) ~ 279). Block 0: cached at 0, hit once at 50
    # (count 1 + 2^(-50/120) at t=50, E = 50 + 120 log2(1.75) ~ 147). Lower E goes first.
    def run(by_count):
        p = plain(structural_rate=by_count, freq_lanes=False)
        release(p, [0, 1], TEMPLATE, 0.0)
        for t in (1.0, 2.0, 3.0, 4.0):
            p.on_access(1, TEMPLATE, t)
        p.on_release(1, ReleaseInfo(TEMPLATE, 1, 2, False, 4.0))
        p.on_access(0, TEMPLATE, 50.0)
        p.on_release(0, ReleaseInfo(TEMPLATE, 0, 2, False, 50.0))
        return drain(p)

    assert run(True) == [0, 1]
    assert run(False) == [1, 0]  # by last use: block 1 (t=4) before block 0 (t=50)


def test_structural_rate_history_survives_eviction_through_the_ghost_list():
    # Block 0 (hash h0) earns E > 100 from hits at 1, 2, 3 and is evicted; re-cached at 10
    # as block 5 it resumes from that history (E >= its ghost key > 20), so the fresh
    # block 6 released at 20 (E = 20) goes first.
    p = plain(weighting="reuse", freq_lanes=False)
    h = hash_id_blocks([1, 2])
    p.on_cached(0, h[0], -1, 0.0)
    p.on_release(0, ReleaseInfo(TEMPLATE, 0, 2, False, 0.0))
    for t in (1.0, 2.0, 3.0):
        p.on_access(0, TEMPLATE, t)
    p.on_release(0, ReleaseInfo(TEMPLATE, 0, 2, False, 3.0))
    assert drain(p) == [0]
    p.on_cached(5, h[0], -1, 10.0)
    p.on_release(5, ReleaseInfo(TEMPLATE, 0, 2, False, 10.0))
    p.on_cached(6, h[1], -1, 20.0)
    p.on_release(6, ReleaseInfo(TEMPLATE, 1, 2, False, 20.0))
    assert drain(p) == [6, 5]


def test_horizon_scoring_ranks_by_reuse_within_the_residence_time():
    # Both 1 s old, reuse probability 0.5. An agent block (gaps ~6 s) will almost surely
    # be reused within the 60 s horizon if at all; a chat block (gaps ~118 s) mostly
    # later. Survival alone ranks the agent block lower (it has the shorter tail).
    def run(horizon):
        p = AblationUniCache(weighting="none", online_fit=False, horizon_scoring=horizon, tail_lane=False)
        p.alpha[:] = [0.5] * len(p.alpha)
        release(p, [0], AGENT_CLS, 0.0)
        release(p, [1], CHAT_CLS, 0.0)
        p.on_request(SINGLE, 1.0)
        return drain(p)

    assert run(horizon=True) == [1, 0]
    assert run(horizon=False) == [0, 1]


def test_session_gaps_run_from_the_previous_turns_release_to_the_next_arrival():
    p = UniCachePolicy(fit_prior_weight=20.0)
    p.on_request(CHAT_CLS, 0.0)
    release(p, [0, 1], CHAT_CLS, 40.0)  # the turn finished (decoded) at 40 s
    p.on_request(CHAT_CLS, 100.0)
    assert p.gaps.fit(CHAT).mu == pytest.approx((4.77 * 20 + math.log(60.0)) / 21)
    assert p.gaps.fit(AGENT).mu == pytest.approx(1.81)
    assert p.gaps.fit(EVICT_FIRST) is p.gaps.fit(CHAT)
    # A turn arriving before its predecessor released anything observes no gap.
    p.on_request(CHAT_CLS, 130.0)
    assert p.gaps.fit(CHAT).weight == pytest.approx(21.0)


def test_session_gaps_from_arrivals_when_gap_from_release_is_off():
    p = AblationUniCache(fit_prior_weight=20.0, gap_from_release=False)
    p.on_request(CHAT_CLS, 0.0)
    release(p, [0, 1], CHAT_CLS, 40.0)
    p.on_request(CHAT_CLS, 100.0)
    assert p.gaps.fit(CHAT).mu == pytest.approx((4.77 * 20 + math.log(100.0)) / 21)


def test_session_memory_is_bounded_oldest_first():
    p = UniCachePolicy(max_sessions=2)
    for i, sid in enumerate("abc"):
        release(p, [i], RequestClass(session_id=sid, turn=1, task=Task.CHAT), float(i))
    assert list(p.gaps._seen) == [("default", "b"), ("default", "c")]


def test_accessed_and_removed_blocks_leave_and_stale_entries_are_compacted():
    p = plain()
    for i in range(500):
        release(p, [7], CHAT_CLS, float(i))
        p.on_access(7, CHAT_CLS, float(i) + 0.5)
    assert len(p) == 0
    assert max(len(h) for h in p._heaps) <= 2 * 0 + 64 + 1
    release(p, [1, 2], SINGLE, 600.0)
    p.on_removed(2)
    assert p.queue_sizes()["evict_first"] == 1
    assert drain(p) == [1]


def test_lognormal_fit():
    f = OnlineLogNormal(mu=4.77, sigma=1.279)
    assert f.survival(0.0) == 1.0
    assert f.survival(math.exp(4.77)) == pytest.approx(0.5)
    for _ in range(5000):
        f.observe(math.e**2)
    assert f.mu == pytest.approx(2.0, abs=0.05)
    assert f.sigma == pytest.approx(0.25)  # floor: identical gaps have zero spread
    assert f.survival(1.0) > f.survival(10.0) > f.survival(100.0)
    frozen = OnlineLogNormal(mu=1.0, sigma=1.0, frozen=True)
    frozen.observe(1000.0)
    assert (frozen.mu, frozen.sigma) == (1.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"update_every": 0}, "update_every > 0"),
        ({"reuse_decay": 0}, "0 < reuse_decay <= 1"),
        ({"ghost_factor": -1}, "ghost_factor >= 0"),
        ({"max_sessions": 0}, "max_sessions must be positive"),
        ({"horizon_scale": 0}, "horizon_scale > 0"),
        ({"structural_rate_halflife_s": 0}, "structural_rate_halflife_s must be positive"),
    ],
)
def test_bad_tunables_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UniCachePolicy(**kwargs)


@pytest.mark.parametrize("name", ["depth_bonus_s", "structural_fit", "strict_evict_first", "weighting", "turn_lanes"])
def test_ablation_switches_are_not_production_options(name):
    with pytest.raises(ValueError, match=f"eviction policy 'unicache' does not take {name}"):
        make_policy("unicache", **{name: True})


@pytest.mark.parametrize("kwargs", [{"weighting": "nope"}, {"weighting": "efficiency", "efficiency_kwargs": {"temperature": 0}},
                                    {"weighting": "efficiency", "efficiency_kwargs": {"alpha_ema": 0}}])
def test_bad_ablation_switches_raise(kwargs):
    with pytest.raises(ValueError):
        AblationUniCache(**kwargs)


def test_paper_efficiency_weights_from_hits_per_unit_of_capacity():
    p = AblationUniCache(
        weighting="efficiency", update_every=2, efficiency_kwargs=dict(alpha_ema=1.0, temperature=1.0),
        online_fit=False, tail_lane=False,
    )
    release(p, [1], CHAT_CLS, 0.0)
    release(p, [2], SINGLE, 0.5)
    p.on_request(SINGLE, 1.0)
    p.on_access(1, CHAT_CLS, 1.0)
    release(p, [1], CHAT_CLS, 1.5)
    p.on_request(SINGLE, 2.0)
    # E_chat = 1 hit / mean size 1, E_evict_first = 0: mean E = 0.5.
    assert p.weight(CHAT, turn=1) == pytest.approx(2.0)
    assert p.weight(EVICT_FIRST) == pytest.approx(0.05)  # no hits: clipped to alpha_min
    assert drain(p) == [2, 1]


def test_last_prompt_block_gets_its_own_lane_and_reuse_estimate():
    # Two requests: 3 prompt blocks + 1 decode block, released tail first. The decode
    # block goes first in release order; the last prompt block (2, 6) is the tail lane.
    p = AblationUniCache(online_fit=False, horizon_scoring=False, update_every=1)
    release(p, [0, 1, 2, 3], SINGLE, 0.0, num_prompt_blocks=3)
    release(p, [4, 5, 6, 7], SINGLE, 0.0, num_prompt_blocks=3)
    tail = EVICT_FIRST * NUM_LANES + TAIL_LANE
    assert {entry[2] for entry in p._heaps[tail]} == {2, 6}
    # The tail blocks are never reused, the others are: the tail lane goes first.
    for bid in (0, 1, 4, 5):
        p.on_access(bid, SINGLE, 1.0)
    release(p, [0, 1], SINGLE, 1.5)  # a shorter prompt: its last block 1 is a tail now
    p.on_request(SINGLE, 2.0)
    assert p.alpha[tail] == pytest.approx(0.1 / 4.0)
    assert drain(p)[:2] == [2, 6]


def _mixed_history(p):
    """Blocks of every queue, released at different times, some hit again."""
    release(p, [0, 1, 2, 3], SINGLE, 1.0, num_prompt_blocks=3)
    release(p, [4, 5, 6], CHAT_CLS, 2.0)
    release(p, [7, 8], AGENT_CLS, 3.0)
    for b in (9, 10, 11):
        p.on_cached(b, hash_id_blocks([b], 1)[0], -1, 4.0)
    release(p, [9, 10, 11], TEMPLATE, 4.0)
    p.on_access(5, CHAT_CLS, 5.0)
    p.on_request(CHAT_CLS, 6.0)
    release(p, [12, 13], CHAT_CLS, 7.0)


@pytest.mark.parametrize(
    "kw, order",
    [
        # From a cold start evict-first (0-3, and 11: the template's suffix) weighs 0.1
        # against 0.5 elsewhere, so it goes first; then the structural blocks 10, 9.
        # 11 was cached from the root and never hit (a novel prefix): the novel lane is
        # emptied first, whatever the weights.
        ({"gap_from_release": False}, [11, 3, 1, 0, 2, 10, 9, 4, 12, 6, 13, 7, 8]),
        ({"gap_from_release": False, "novel_lane": False}, [3, 1, 0, 2, 11, 10, 9, 4, 12, 6, 13, 7, 8]),
        # Strict evict-first: every evict-first block (0-3 and 11, the template's
        # suffix) before the rest, the tail-lane block 2 and the novel block 11 included.
        ({"gap_from_release": False, "strict_evict_first": True}, [11, 3, 1, 0, 2, 10, 9, 4, 12, 6, 13, 7, 8]),
        ({"gap_from_release": False, "weighting": "efficiency"}, [11, 10, 9, 7, 8, 3, 1, 0, 2, 4, 6, 12, 13]),
        ({}, [11, 3, 1, 0, 2, 10, 9, 4, 12, 6, 13, 7, 8]),
    ],
)
def test_pop_victims_is_pop_victim_n_times(kw, order):
    one, batch = AblationUniCache(**kw), AblationUniCache(**kw)
    _mixed_history(one)
    _mixed_history(batch)
    singles = drain(one)
    assert singles == order
    assert batch.pop_victims(3) + batch.pop_victims(100) == order
    assert batch.pop_victims(1) == [] and batch.pop_victim() is None
    assert (batch.residence._victims, batch.residence._age_sum) == (one.residence._victims, one.residence._age_sum)
    assert list(batch.weights.ghosts.items()) == list(one.weights.ghosts.items())


def test_lane_scores_are_the_horizon_formula_over_lognormal_survival():
    p = UniCachePolicy()
    _mixed_history(p)
    p.on_request(SINGLE, 40.0)
    heads = {lane: min(e[0] for e in heap if p._live.get(e[2]) is e) for lane, heap in enumerate(p._heaps) if heap}
    victim = p.pop_victims(1)
    tau = p.residence.tau
    want = [math.inf] * len(p._scores)
    for lane, key in heads.items():
        a, alpha = 40.0 - key, p.alpha[lane]
        if lane // NUM_LANES == STRUCTURAL:
            h = p.rate.halflife
            rate = math.exp(-a * math.log(2.0) / h) * math.log(2.0) / h
            want[lane] = alpha * -math.expm1(-rate * tau)
        else:
            fit = p.gaps.fit(lane // NUM_LANES)
            s = fit.survival(a)
            want[lane] = alpha * (s - fit.survival(a + tau)) / (1.0 - alpha + alpha * s + 1e-12)
    assert p._scores == want  # exactly: the written-out arithmetic is survival()'s
    assert victim == [11]  # the novel lane first, whatever its score
    assert p.pop_victims(1) == [3]  # then the lowest score: evict-first (prior 0.1)


def test_strict_evict_first_drains_every_evict_first_lane_before_sessions():
    # Block 1 is its request's last prompt block (the tail lane), block 0 is in lane 0;
    # the chat blocks are older. Strict: both evict-first blocks go first (equal scores:
    # the lower lane first, so 0 before 1 and the chat's turn lane 2 before its tail 3).
    p = plain(strict_evict_first=True, tail_lane=True)
    release(p, [2, 3], CHAT_CLS, 1.0)
    release(p, [0, 1], SINGLE, 5.0)
    p.on_request(SINGLE, 9.0)
    assert drain(p) == [0, 1, 2, 3]


def test_residence_time_averages_ages_since_release_not_effective_times():
    # A template block used at 0, 1 and 2 s has an effective time far past its last
    # release (E ~ 2 + 120 log2(2.98) ~ 191 s); evicted at 50 s it stayed 48 s.
    p = UniCachePolicy()
    p.on_cached(0, hash_id_blocks([1])[0], -1, 0.0)
    for t in (0.0, 1.0, 2.0):
        if t:
            p.on_access(0, TEMPLATE, t)
        p.on_release(0, ReleaseInfo(TEMPLATE, 0, 2, False, t))
    assert p.rate.effective[0] > 190.0
    p.on_request(SINGLE, 50.0)
    assert p.pop_victims(1) == [0]
    p.on_request(SINGLE, 50.0)
    assert p.residence.ema == pytest.approx(0.99 * 60.0 + 0.01 * 48.0)


# ------------------------------------------------------------ novel prefixes
def _cache(p, block_id, parent_id, now):
    """Cache ``block_id`` under ``parent_id`` (-1: the root) with a hash of its own."""
    p.on_cached(block_id, hash_id_blocks([block_id], 1)[0], parent_id, now)


def _lane_of(p, block_id):
    return p._live[block_id][3] - EVICT_FIRST * NUM_LANES


def test_novel_prefix_blocks_are_chains_from_the_root_never_hit_never_ghosts():
    p = plain(weighting="reuse")
    _cache(p, 0, -1, 0.0)  # a prompt that shares nothing: 0 <- 1
    _cache(p, 1, 0, 0.0)
    release(p, [0, 1], SINGLE, 0.0)
    assert [_lane_of(p, b) for b in (0, 1)] == [NOVEL_LANE, NOVEL_LANE]
    p.on_access(0, SINGLE, 1.0)  # another request shares block 0: no longer novel
    _cache(p, 2, 0, 1.0)  # ... and its own block under it is not novel either
    release(p, [0, 2], SINGLE, 1.0)
    assert [_lane_of(p, b) for b in (0, 1, 2)] == [1, NOVEL_LANE, 0]  # 0: hit once
    assert p.pop_victims(3) == [1, 2, 0]
    _cache(p, 7, -1, 2.0)  # block 1's hash again, cached from its ghost: seen before
    p.on_cached(8, hash_id_blocks([1], 1)[0], 7, 2.0)
    release(p, [7, 8], SINGLE, 2.0)
    assert [_lane_of(p, b) for b in (7, 8)] == [NOVEL_LANE, 0]
    # Only evict-first blocks take the novel lane: a session's own prompt keeps its queue.
    _cache(p, 9, -1, 3.0)
    release(p, [9], CHAT_CLS, 3.0)
    assert p._live[9][3] // NUM_LANES == CHAT
    assert p.pop_victims(10) and p._novel == set()


def test_one_off_prompts_leave_before_older_blocks_of_a_shared_prefix():
    # Requests share the head block 0 and each adds a block under it (1, then 2); later
    # one-off prompts (10 <- 11, then 12) share nothing. The novel lane is emptied first:
    # the one-off blocks go before the older shared-prefix ones. Weighed instead (an
    # ablation), its measured reuse 1.1 / 5 (block 0's hit while it was novel) against
    # lane 0's 1.1 / 3 still puts them before blocks 1 and 2 but after block 0, whose
    # lane (hit twice) has no evidence yet beyond evict-first's prior (0.1 / 2); in one
    # lane (the ablation without it) age decides: the older block 2 goes before them.
    def run(novel_lane, novel_first=True):
        p = plain(weighting="reuse", update_every=1, novel_lane=novel_lane, novel_first=novel_first)
        _cache(p, 0, -1, 0.0)
        release(p, [0], SINGLE, 0.0)
        p.on_access(0, SINGLE, 1.0)
        _cache(p, 1, 0, 1.0)
        release(p, [0, 1], SINGLE, 1.0)
        p.on_access(0, SINGLE, 2.0)
        p.on_access(1, SINGLE, 2.0)
        _cache(p, 2, 1, 2.0)
        release(p, [0, 1, 2], SINGLE, 2.0)
        _cache(p, 10, -1, 3.0)
        _cache(p, 11, 10, 3.0)
        release(p, [10, 11], SINGLE, 3.0)
        _cache(p, 12, -1, 4.0)
        release(p, [12], SINGLE, 4.0)
        p.on_request(SINGLE, 5.0)
        return p, drain(p)

    p, order = run(True)
    assert p.alpha[EVICT_FIRST * NUM_LANES + NOVEL_LANE] == pytest.approx(1.1 / 5.0)
    assert p.alpha[EVICT_FIRST * NUM_LANES] == pytest.approx(1.1 / 3.0)
    assert order == [11, 10, 12, 0, 2, 1]
    assert run(True, novel_first=False)[1] == [0, 11, 10, 12, 2, 1]
    assert run(False)[1] == [0, 2, 11, 10, 12, 1]


def test_adaptive_novel_first_empties_the_novel_lane_only_while_its_reuse_is_the_lowest():
    # The ablation variant: novel-first while no other non-empty lane has a lower measured
    # reuse probability (alpha); else the novel lane competes on its score.
    from unicache.replica.eviction.unicache.policy import _NOVEL

    p = plain(adaptive_novel_first=True)
    other, empty = 3, 5
    assert other != _NOVEL != empty
    p._lane_sizes[_NOVEL] = p._lane_sizes[other] = 1
    p._lane_sizes[empty] = 0
    scores = [float("inf")] * len(p._lane_sizes)
    scores[_NOVEL], scores[other] = 0.4, 0.1
    p.weights.alpha[_NOVEL], p.weights.alpha[other], p.weights.alpha[empty] = 0.3, 0.5, 0.0
    assert p._choose(scores) == _NOVEL  # the lowest reuse of the non-empty lanes (an empty one does not count)
    p.weights.alpha[other] = 0.2
    assert p._choose(scores) == other  # another lane is reused less: the scores decide
    p._lane_sizes[_NOVEL] = 0
    scores[_NOVEL] = float("inf")
    assert p._choose(scores) == other
