"""The candidate window of large fleets (unicache.router.routing.cache_aware.candidates) and
cache_aware's use of it: exact members, kept holders, unchanged small fleets."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RoutingRequest
from unicache.router.routing.cache_aware.candidates import CandidateWindow
from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy

BS = 16


def fleet(n: int, queued=None) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i:04d}", queued_prefill_tokens=(queued[i] if queued else 0), free_blocks=1000,
                        capacity_blocks=1000) for i in range(n)]


def ids(replicas) -> list[str]:
    return [r.replica_id for r in replicas]


def test_small_fleets_and_size_zero_get_the_fleet_itself():
    reps = fleet(8)
    assert CandidateWindow(8).select(reps, ["r0003"], clock=5) is reps
    assert CandidateWindow(0).select(fleet(100), [], clock=5) is not None
    big = fleet(100)
    assert CandidateWindow(0).select(big, [], clock=5) is big
    with pytest.raises(ValueError, match=">= 0"):
        CandidateWindow(-1)


def test_the_window_moves_by_its_size_per_clock_tick_and_wraps_and_the_least_queued_joins():
    reps = fleet(10, queued=[9, 9, 9, 9, 9, 9, 3, 9, 3, 9])  # r0006 is the first of the least queued
    w = CandidateWindow(4)
    assert ids(w.select(reps, [], clock=0)) == ["r0000", "r0001", "r0002", "r0003", "r0006"]
    assert ids(w.select(reps, [], clock=1)) == ["r0004", "r0005", "r0006", "r0007"]
    # clock 2: start 8, the window wraps to the fleet's start; the fleet's order is kept
    assert ids(w.select(reps, [], clock=2)) == ["r0000", "r0001", "r0006", "r0008", "r0009"]
    assert ids(w.select(reps, [], clock=3)) == ["r0002", "r0003", "r0004", "r0005", "r0006"]


def test_kept_replicas_join_the_window_once_in_fleet_order_and_unknown_ones_are_ignored():
    reps = fleet(20)
    w = CandidateWindow(3)
    got = w.select(reps, ["r0009", None, "gone", "r0001", "r0009", "r0005"], clock=1)
    assert ids(got) == ["r0000", "r0001", "r0003", "r0004", "r0005", "r0009"]  # r0000: the least queued (a tie: the first)
    # half the fleet or more kept: the whole fleet, no lookups
    assert w.select(reps, ["r0001"] * 10, clock=0) is reps


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 120), size=st.integers(1, 40), clock=st.integers(0, 10_000),
       keep=st.lists(st.integers(0, 130), max_size=12))
def test_the_candidates_are_the_window_plus_the_kept_offered_replicas(data, n, size, clock, keep):
    queued = data.draw(st.lists(st.sampled_from([0, 5, 100]), min_size=n, max_size=n))
    reps = fleet(n, queued)
    names = [f"r{i:04d}" for i in keep]
    got = CandidateWindow(size).select(reps, names, clock)
    if n <= size or 2 * len(names) >= n:
        assert got is reps
        return
    start = (clock * size) % n
    window = {(start + j) % n for j in range(size)}
    expected = sorted(window | {i for i in keep if i < n} | {queued.index(min(queued))})
    assert ids(got) == [f"r{i:04d}" for i in expected]


def _request(i: int, block_ids) -> RoutingRequest:
    hs = hash_id_blocks(list(block_ids))
    return RoutingRequest(f"q{i}", RequestClass(), hs, len(hs) * BS, BS)


def _replay(policy: CacheAwarePolicy, reps, index, requests) -> list[str]:
    out = []
    for req in requests:
        d = policy.choose(req, reps, index)
        policy.on_request_routed(req, d)
        out.append(d.replica_id)
    return out


def test_fleets_up_to_the_window_decide_exactly_as_without_it():
    rng = random.Random(7)
    reps = fleet(64, queued=[rng.choice([0, 100, 5000]) for _ in range(64)])
    index = LocalityIndex()
    for r in reps[::5]:
        index.apply_events_unchecked(r.replica_id, hash_id_blocks([1, 2, 3, rng.randrange(100)]), [])
    requests = [_request(i, [1, 2, 3, rng.randrange(100)] if i % 2 else [1000 + i, 7]) for i in range(300)]
    with_window = _replay(CacheAwarePolicy(CacheAwareConfig(candidate_window=64)), reps, index, requests)
    assert with_window == _replay(CacheAwarePolicy(CacheAwareConfig(candidate_window=0)), reps, index, requests)


def test_a_large_fleet_keeps_the_holder_outside_the_window_and_spreads_new_prompts():
    reps = fleet(1024)
    index = LocalityIndex()
    index.apply_events_unchecked("r0900", hash_id_blocks(list(range(1, 33))), [])
    p = CacheAwarePolicy(CacheAwareConfig(candidate_window=64))
    p.update_replicas(ids(reps))
    held = _request(0, range(1, 33))
    # clock 0: the window is r0000-r0063; the holder r0900 is weighed anyway, and wins
    assert p.choose(held, reps, index).replica_id == "r0900"
    # prompts no replica holds: 16 decisions walk 16 windows, 1,024 distinct replicas' worth
    chosen = _replay(p, reps, index, [_request(i, [5000 + i]) for i in range(1, 17)])
    starts = [(k * 64) % 1024 for k in range(16)]
    assert all(int(rid[1:]) in range(s, s + 64) for rid, s in zip(chosen, starts))
    assert len(set(chosen)) == 16


def test_a_system_prompt_on_every_replica_groups_its_holders_and_the_long_holder_still_wins():
    from unicache.router.routing.cache_aware.policy import matches_of_candidates

    reps = fleet(1024)
    index = LocalityIndex()
    prompt = hash_id_blocks(list(range(1, 33)))
    for r in reps:
        index.apply_events_unchecked(r.replica_id, prompt[:1], [])  # the shared first block
    index.apply_events_unchecked("r0900", prompt, [])
    deep, groups = index.prefix_match_groups(prompt, 512)
    assert deep == {"r0900": 32} and groups == [(1, {r.replica_id for r in reps} - {"r0900"})]
    # a candidate's match comes from its group; one neither deep nor grouped matches nothing
    cands = [reps[3], reps[900]]
    assert matches_of_candidates(deep, groups, cands) == {"r0900": 32, "r0003": 1}
    assert matches_of_candidates({}, [(2, {"r0005"})], cands) == {}
    p = CacheAwarePolicy()
    p.update_replicas(ids(reps))
    req = RoutingRequest("q0", RequestClass(), prompt, len(prompt) * BS, BS)
    d = p.choose(req, reps, index)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0900", "index_prefix", 32)
    # a prompt sharing only the first block: every candidate matches 1; the choice is a window
    # member or the least-queued replica (r0000, all queues 0), never one outside them
    other = hash_id_blocks([1, 77, 78])
    d = p.choose(RoutingRequest("q1", RequestClass(), other, 3 * BS, BS), reps, index)
    assert d.matched_blocks == 1 and (int(d.replica_id[1:]) < 32 or d.replica_id == "r0900")


def test_held_prompts_the_holders_decide_are_routed_exactly_as_over_the_whole_fleet():
    """When TTFT admission can decide among the holders alone (they are clearly fastest),
    a large fleet skips the window and decides exactly as weighing every replica."""
    rng = random.Random(3)
    reps = fleet(100, queued=[rng.choice([0, 40, 80]) for _ in range(100)])
    index = LocalityIndex()
    prompts = [list(range(1000 * k, 1000 * k + 20)) for k in range(6)]
    for k, ids_ in enumerate(prompts):
        for r in rng.sample(reps, 5):
            index.apply_events_unchecked(r.replica_id, hash_id_blocks(ids_), [])
    requests = [_request(i, rng.choice(prompts)) for i in range(120)]
    p = CacheAwarePolicy()
    assert all(p.admission.decided_by_matches(reps, q.num_prompt_tokens, BS, index.prefix_matches(q.block_hashes))
               for q in requests[:6])
    assert _replay(p, reps, index, requests) == _replay(CacheAwarePolicy(CacheAwareConfig(candidate_window=0)), reps, index, requests)


def test_a_host_tier_run_outside_the_window_is_weighed():
    reps = fleet(1024)
    index = LocalityIndex()
    prompt = hash_id_blocks(list(range(1, 33)))
    index.apply_summary("r0700", 1, 0, [], host_hashes=prompt)  # the whole prompt demoted to host memory
    p = CacheAwarePolicy()
    p.update_replicas(ids(reps))
    d = p.choose(RoutingRequest("q0", RequestClass(), prompt, len(prompt) * BS, BS), reps, index)
    # clock 0: the window is r0000-r0031; the host run makes r0700 a candidate, and it wins
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0700", "host_prefix", 32)
    assert CacheAwarePolicy(CacheAwareConfig(host_cost=1.0)).choose(
        RoutingRequest("q1", RequestClass(), prompt, len(prompt) * BS, BS), reps, index).replica_id != "r0700"


def test_a_grouped_replica_whose_host_tier_continues_the_prompt_is_weighed():
    """A system prompt on every replica groups its holders; r0700 holds it on GPU like the
    rest and the whole remaining prompt in host memory: it is outside the window (clock 0:
    r0000-r0031) and in a group, and still found and chosen for its host run."""
    reps = fleet(1024)
    index = LocalityIndex()
    prompt = hash_id_blocks(list(range(1, 33)))
    for r in reps:
        index.apply_events_unchecked(r.replica_id, prompt[:1], [])
    index.apply_events_unchecked("r0700", [], [], host_stored=prompt[1:])
    deep, groups = index.prefix_match_groups(prompt, 512)
    assert deep == {} and groups == [(1, set(ids(reps)))]
    assert index.tier_runs(prompt, deep, groups) == {"r0700": (31, ())}
    p = CacheAwarePolicy()
    p.update_replicas(ids(reps))
    d = p.choose(RoutingRequest("q0", RequestClass(), prompt, len(prompt) * BS, BS), reps, index)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0700", "host_prefix", 32)
    # the same decision as weighing every replica
    full = CacheAwarePolicy(CacheAwareConfig(candidate_window=0))
    full.update_replicas(ids(reps))
    assert full.choose(RoutingRequest("q0", RequestClass(), prompt, len(prompt) * BS, BS), reps, index) == d
