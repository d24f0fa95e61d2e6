"""Routing policies on hand-built states: exact choices, ties, imbalance, stickiness, death."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest, SharesRouterState
from unicache.router.routing.baselines.session_affinity import SessionAffinityPolicy
from unicache.router.routing.baselines.sglang import SGLangPolicy
from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy, common_prefix_blocks
from unicache.router.routing.keys import HashRing, ring_hash, session_key
from unicache.router.routing.registry import make_routing_policy, routing_policy_names

BS = 16


def hashes(*ids: int):
    return hash_id_blocks(list(ids))


def make_request(rid: str, block_ids, *, session=None, tenant="default", template_blocks=0, extra_tokens=0):
    hs = hashes(*block_ids)
    cls = RequestClass(tenant=tenant, session_id=session, task=Task.CHAT if session else Task.OTHER,
                       template=template_blocks > 0, template_blocks=template_blocks)
    return RoutingRequest(rid, cls, hs, len(hs) * BS + extra_tokens, BS)


def load(rid, out=0, queued=0, free=1000, cap=1000, running=None):
    return ReplicaLoad(rid, running=out if running is None else running, queued_prefill_tokens=queued,
                       free_blocks=free, capacity_blocks=cap, in_flight=out)


def make_index(holdings: dict[str, list[int]]) -> LocalityIndex:
    """``holdings[r]`` lists the block ids of one chain r holds (a prefix of that chain)."""
    idx = LocalityIndex()
    for rid, ids in holdings.items():
        idx.apply_events_unchecked(rid, hashes(*ids), [])
    return idx


EMPTY = LocalityIndex()
THREE = [load("r0"), load("r1"), load("r2")]


def test_registry_builds_every_policy():
    assert routing_policy_names() == ["cache_aware", "least_loaded", "round_robin", "session_affinity", "sglang"]
    for name in routing_policy_names():
        assert make_routing_policy(name).name == name


# -- round robin / least loaded ---------------------------------------------------------


def test_cache_aware_config_is_frozen_validated_and_built_by_the_registry():
    import dataclasses

    cfg = CacheAwareConfig(fit_first=False, max_sessions=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fit_first = True  # type: ignore[misc]
    p = CacheAwarePolicy(cfg)
    assert (p.config, p.config.fit_first, p.config.max_sessions) == (cfg, False, 7)
    assert CacheAwarePolicy().config == CacheAwareConfig()
    for bad, field in ((dict(churn_window=0), "churn_window"), (dict(host_cost=1.5), "host_cost"),
                       (dict(session_hold_frac=-0.1), "session_hold_frac"),
                       (dict(template_key_blocks=-1), "template_key_blocks"),
                       (dict(admission_factor=0.5), "admission_factor"), (dict(prefill_lanes=0), "prefill_lanes"),
                       (dict(virtual_nodes=0), "virtual_nodes"), (dict(candidate_window=-1), "candidate_window")):
        with pytest.raises(ValueError, match=field):
            CacheAwareConfig(**bad)
    built = make_routing_policy("cache_aware", fit_first=False, max_sessions=7)
    assert isinstance(built, CacheAwarePolicy) and built.config == cfg
    with pytest.raises(ValueError, match=r"^routing policy 'cache_aware' does not take bogus \(its arguments: load_weight, "):
        make_routing_policy("cache_aware", bogus=1)
    with pytest.raises(TypeError):
        CacheAwarePolicy(fit_first=False)  # type: ignore[call-arg]


def test_only_cache_aware_shares_router_state():
    """Sharing state between routers is a capability of its own, checked with isinstance;
    the plug-in interface itself is ``choose`` plus lifecycle hooks."""
    shares = {name: isinstance(make_routing_policy(name), SharesRouterState) for name in routing_policy_names()}
    assert shares == {name: name == "cache_aware" for name in routing_policy_names()}
    hooks = {n for n in vars(RoutingPolicy) if not n.startswith("_") and callable(vars(RoutingPolicy)[n])}
    assert hooks == {"choose", "update_replicas", "on_request_routed", "on_first_token", "on_request_finished",
                     "on_replica_died"}


def test_round_robin_cycles_in_id_order():
    p = make_routing_policy("round_robin")
    got = [p.choose(make_request(f"q{i}", [1]), [load("r2"), load("r0"), load("r1")], EMPTY).replica_id for i in range(4)]
    assert got == ["r0", "r1", "r2", "r0"]


def test_least_loaded_order_and_ties():
    p = make_routing_policy("least_loaded")
    req = make_request("q", [1, 2])
    assert p.choose(req, [load("r0", out=3), load("r1", out=1), load("r2", out=2)], EMPTY).replica_id == "r1"
    # Equal outstanding: fewer queued prefill tokens wins; then the replica id.
    assert p.choose(req, [load("r0", out=1, queued=50), load("r1", out=1, queued=10)], EMPTY).replica_id == "r1"
    assert p.choose(req, [load("r1", out=1), load("r0", out=1)], EMPTY).replica_id == "r0"
    # outstanding is max(router in-flight, replica running + waiting).
    busy = ReplicaLoad("r0", running=5, waiting=2, in_flight=1)
    assert p.choose(req, [busy, load("r1", out=6)], EMPTY).replica_id == "r1"


# -- session affinity -------------------------------------------------------------------


def reference_owner(members, key, vnodes):
    """Independent brute force: the member owning the smallest point >= hash (wrapping)."""
    h = ring_hash(key)
    points = [(ring_hash(f"{r}#{i}"), r) for r in members for i in range(vnodes)]
    after = [p for p in points if p[0] >= h]
    return min(after)[1] if after else min(points)[1]


def test_session_affinity_matches_reference_ring():
    p = SessionAffinityPolicy(virtual_nodes=20)
    reps = [load("r0"), load("r1"), load("r2"), load("r3")]
    p.update_replicas([r.replica_id for r in reps])
    for i in range(200):
        req = make_request(f"q{i}", [i], session=f"s{i}")
        expect = reference_owner(["r0", "r1", "r2", "r3"], session_key("default", f"s{i}"), 20)
        assert p.choose(req, reps, EMPTY).replica_id == expect


def test_session_affinity_sticky_and_tenant_scoped():
    p = SessionAffinityPolicy()
    reps = [load("r0"), load("r1"), load("r2"), load("r3")]
    first = p.choose(make_request("a", [1], session="s"), reps, EMPTY).replica_id
    # Load does not move a session.
    busy = [load(r.replica_id, out=50 if r.replica_id == first else 0) for r in reps]
    d = p.choose(make_request("b", [1, 2], session="s"), busy, EMPTY)
    assert (d.replica_id, d.reason) == (first, "session_hash")
    # The same session id of other tenants spreads over the ring (not all on one replica).
    owners = {p.choose(make_request("c", [1], session="s", tenant=f"t{i}"), reps, EMPTY).replica_id for i in range(40)}
    assert len(owners) > 1


def test_session_affinity_without_session_is_least_loaded():
    p = SessionAffinityPolicy()
    d = p.choose(make_request("a", [1]), [load("r0", out=2), load("r1", out=1)], EMPTY)
    assert (d.replica_id, d.reason) == ("r1", "no_session_least_loaded")


def test_session_affinity_stable_when_replicas_leave_and_join():
    p = SessionAffinityPolicy()
    four = [load(f"r{i}") for i in range(4)]
    p.update_replicas([r.replica_id for r in four])
    before = {i: p.choose(make_request("q", [1], session=f"s{i}"), four, EMPTY).replica_id for i in range(400)}
    assert set(before.values()) == {"r0", "r1", "r2", "r3"}
    # r2 dies: only r2's sessions move; each goes to the next live owner on the ring.
    p.on_replica_died("r2")
    three = [r for r in four if r.replica_id != "r2"]
    after = {i: p.choose(make_request("q", [1], session=f"s{i}"), three, EMPTY).replica_id for i in range(400)}
    for i in range(400):
        if before[i] != "r2":
            assert after[i] == before[i]
        else:
            assert after[i] == reference_owner(["r0", "r1", "r3"], session_key("default", f"s{i}"), 160)
    # r4 joins (announced only through choose): sessions move only onto r4.
    five = three + [load("r4")]
    joined = {i: p.choose(make_request("q", [1], session=f"s{i}"), five, EMPTY).replica_id for i in range(400)}
    moved = [i for i in range(400) if joined[i] != after[i]]
    assert moved and all(joined[i] == "r4" for i in moved)
    # A replica missing from the live list (not yet declared dead) is skipped too.
    ring = HashRing(160)
    ring.set_members(["r0", "r1"])
    assert ring.owner("k", {"r1"}) == "r1"


# -- sglang -----------------------------------------------------------------------------


def test_sglang_smallest_tree_then_cache_match():
    p = SGLangPolicy()
    two = [load("r0"), load("r1")]
    d = p.choose(make_request("a", range(10)), two, EMPTY)
    assert (d.replica_id, d.reason) == ("r0", "smallest_tree")  # both empty: tie by id
    d = p.choose(make_request("b", range(100, 110)), two, EMPTY)
    assert (d.replica_id, d.reason) == ("r1", "smallest_tree")  # r0's tree now has 10
    # 4 of 10 blocks match on r0: rate 0.4 > 0.3.
    d = p.choose(make_request("c", [0, 1, 2, 3, 50, 51, 52, 53, 54, 55]), two, EMPTY)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "cache_match", 4)
    assert d.score == pytest.approx(0.4)


def test_sglang_threshold_is_strict():
    p = SGLangPolicy()
    two = [load("r0"), load("r1")]
    p.choose(make_request("a", range(10)), two, EMPTY)  # -> r0 (10 blocks)
    p.choose(make_request("b", range(100, 120)), two, EMPTY)  # -> r1 (20 blocks)
    # 3 of 10 blocks = 0.3, not > 0.3: smallest tree (r0, 10 blocks < 20) -- by size, not match.
    d = p.choose(make_request("c", [100, 101, 102, 7, 8, 9, 10, 11, 12, 13]), two, EMPTY)
    assert (d.replica_id, d.reason) == ("r0", "smallest_tree")


def test_sglang_imbalance_uses_shortest_queue_and_still_inserts():
    p = SGLangPolicy()
    p.choose(make_request("a", range(10)), [load("r0"), load("r1")], EMPTY)  # r0 holds 0..9
    req = make_request("b", range(10))
    # diff 70 > 64 and 100 > 1.5 * 30: imbalanced -> shortest queue r1.
    d = p.choose(req, [load("r0", out=100), load("r1", out=30)], EMPTY)
    assert (d.replica_id, d.reason) == ("r1", "imbalanced_shortest_queue")
    assert p.tree("r1").match(req.block_hashes) == 10
    # diff 60 <= 64: balanced. diff 66 but 200 <= 1.5 * 134: balanced. Both -> longest match,
    # and r1 touched the matched block last, so the tie between r0 and r1 goes to r1.
    assert p.choose(req, [load("r0", out=100), load("r1", out=40)], EMPTY).reason == "cache_match"
    d = p.choose(req, [load("r0", out=134), load("r1", out=200)], EMPTY)
    assert (d.replica_id, d.reason) == ("r1", "cache_match")


def test_sglang_match_tie_goes_to_most_recent_holder():
    p = SGLangPolicy()
    p.tree("r0").insert(hashes(1, 2, 3), tick=5)
    p.tree("r1").insert(hashes(1, 2, 3, 4), tick=3)
    p.tree("r2").insert(hashes(1, 2), tick=9)
    d = p.choose(make_request("q", [1, 2, 3, 9]), THREE, EMPTY)
    assert (d.replica_id, d.matched_blocks) == ("r0", 3)  # r0 and r1 match 3; r0 touched at 5 > 3


def test_sglang_ignores_the_real_index_and_trees_forget_dead_replicas():
    p = SGLangPolicy()
    idx = make_index({"r1": list(range(10))})
    d = p.choose(make_request("a", range(10)), [load("r0"), load("r1")], idx)
    assert d.replica_id == "r0"  # approximate trees are empty; the index is not consulted
    p.on_replica_died("r0")
    d = p.choose(make_request("b", range(10)), [load("r1"), load("r2")], idx)
    assert (d.replica_id, d.reason) == ("r1", "smallest_tree")
    p.update_replicas(["r2"])
    assert set(p.trees) == {"r2"}


def test_sglang_tree_evicts_lru_leaves_first():
    p = SGLangPolicy(max_tree_tokens=5 * BS)
    one = [load("r0")]
    p.choose(make_request("a", [1, 2, 3]), one, EMPTY)
    p.choose(make_request("b", [1, 2, 7]), one, EMPTY)  # tree {1,2,3,7}
    p.choose(make_request("c", [8, 9]), one, EMPTY)  # 6 > 5: evict the LRU leaf, 3
    t = p.tree("r0")
    assert t.match(hashes(1, 2, 3)) == 2
    assert t.match(hashes(1, 2, 7)) == 3
    assert t.match(hashes(8, 9)) == 2
    assert len(t) == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=30), st.integers(1, 12))
def test_sglang_tree_stays_prefix_closed(paths, bound):
    """Leaf-first eviction: a tree never holds a block without all of its ancestors."""
    p = SGLangPolicy(max_tree_tokens=bound * BS)
    for i, ids in enumerate(paths):
        p.choose(make_request(f"q{i}", ids), [load("r0")], EMPTY)
        t = p.tree("r0")
        assert len(t) <= bound
        for seen in paths[: i + 1]:
            held = [h in t.nodes for h in hashes(*seen)]
            assert held == sorted(held, reverse=True)


# -- cache_aware ------------------------------------------------------------------------


def test_cache_aware_longest_prefix_wins_at_equal_load():
    p = CacheAwarePolicy()  # no routing history: the churn term is 0
    idx = make_index({"r0": [1, 2], "r1": list(range(1, 9)), "r2": [1, 2, 3]})
    d = p.choose(make_request("q", range(1, 11)), THREE, idx)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r1", "index_prefix", 8)
    assert d.score == pytest.approx(160 - 128)


def test_cache_aware_no_match_ties_to_least_loaded_then_id():
    p = CacheAwarePolicy()
    d = p.choose(make_request("q", range(10)), [load("r2"), load("r1"), load("r0")], EMPTY)
    assert (d.replica_id, d.reason) == ("r0", "load")
    d = p.choose(make_request("q", range(10)), [load("r0", out=1), load("r1"), load("r2", out=1)], EMPTY)
    assert d.replica_id == "r1"


def test_cache_aware_load_outweighs_a_short_match():
    p = CacheAwarePolicy()
    idx = make_index({"r1": [0, 1]})
    reps = [load("r0"), load("r1", queued=400)]
    # r0: 160 - 0 + 0 = 160; r1: 160 - 32 * (1 - 0.5 * 0.025) + 400 / 4 lanes = 228.4
    # (pressure: 25 of 1,000 blocks)
    d = p.choose(make_request("q", range(10)), reps, idx)
    assert (d.replica_id, d.score) == ("r0", 160.0)
    idx = make_index({"r1": list(range(8))})
    # r1: 160 - 128 * (1 - 0.5 * 0.025) + 100 = 133.6 < 160.
    d = p.choose(make_request("q", range(10)), reps, idx)
    assert (d.replica_id, d.score) == ("r1", pytest.approx(133.6))


def test_cache_aware_ttft_admission_keeps_a_cached_request_off_an_idle_replica():
    p = CacheAwarePolicy()
    idx = make_index({"r1": list(range(10))})
    # r1 runs 10 requests but queues no prefill: its estimated TTFT is 0 tokens (all 160
    # cached), r0's and r2's 160 > 2 x 0, so only r1 is admissible although its cost
    # (1280 of outstanding load) is above r0's 160. Decoding requests do not delay a prefill.
    reps = [load("r0"), load("r1", out=10), load("r2")]
    d = p.choose(make_request("q", range(10)), reps, idx)
    assert (d.replica_id, d.reason, d.matched_blocks, d.score) == ("r1", "index_prefix", 10, 1280.0)


def test_cache_aware_ttft_admission_excludes_a_replica_whose_queue_outweighs_its_cache():
    p = CacheAwarePolicy(CacheAwareConfig(load_weight=0.0))  # the cost ignores load: only admission sees the queue
    idx = make_index({"r1": list(range(10))})
    req = make_request("q", range(10))
    # r1: 0 uncached + 1000 / 4 lanes = 250 <= 2 x 160 (r0, nothing cached): admissible, and
    # its cache wins the cost.
    d = p.choose(req, [load("r0"), load("r1", queued=1000)], idx)
    assert (d.replica_id, d.reason) == ("r1", "index_prefix")
    # 2000 queued: 500 > 320, r1 is not admissible.
    d = p.choose(req, [load("r0"), load("r1", queued=2000)], idx)
    assert (d.replica_id, d.reason) == ("r0", "load")


def test_cache_aware_queue_share_counts_only_the_uncached_part_of_a_queue():
    idx = make_index({"r1": list(range(10))})
    w = make_request("w", range(12))  # r1 holds 10 of its 12 blocks: 32 of 192 tokens uncached
    q = make_request("q", range(10))  # all cached on r1
    reps = [load("r0"), load("r1", queued=2000)]
    shared, whole = CacheAwarePolicy(CacheAwareConfig(load_weight=0.0)), CacheAwarePolicy(CacheAwareConfig(load_weight=0.0, queue_share=False))
    for p in (shared, whole):
        d = p.choose(w, [load("r0"), load("r1")], idx)
        assert (d.replica_id, d.matched_blocks) == ("r1", 10)
        p.on_request_routed(w, d)
    assert shared._queues.share == {"r1": 32 / 192} and shared._queues.own == {"r1": [32, 192]}
    assert whole._queues.share == {} and whole._queues.requests == {}
    # r1's published queue, 2000 whole-prompt tokens, is 2000 x 1/6 uncached by the share:
    # estimate 0 + 333.3 / 4 lanes <= 2 x 160 (r0), so r1 is admissible and its cache wins;
    # counted whole, 500 > 320 and only r0 is.
    assert shared.choose(q, reps, idx).replica_id == "r1"
    assert whole.choose(q, reps, idx).replica_id == "r0"
    # w's first token: nothing of this router's waits at r1, so its queue counts whole again.
    shared.on_first_token(w, "r1")
    assert shared._queues.share == {} and shared._queues.requests == {} and shared._queues.own == {}
    assert shared.choose(q, reps, idx).replica_id == "r0"


def test_cache_aware_queue_share_follows_retries_finishes_bounds_and_departures():
    p = CacheAwarePolicy(CacheAwareConfig(max_inflight=2))
    idx = make_index({"r1": list(range(3))})
    a = make_request("a", range(4))  # 64 tokens
    p.on_request_routed(a, RouteDecision("r0", "load", matched_blocks=0))
    p.on_request_routed(a, RouteDecision("r1", "index_prefix", matched_blocks=3))  # a retry elsewhere
    assert p._queues.own == {"r1": [16, 64]} and p._queues.share == {"r1": 0.25}
    b, c = make_request("b", range(100, 102)), make_request("c", range(200, 203))
    p.on_request_routed(b, RouteDecision("r1", "load", matched_blocks=0))
    p.on_request_routed(c, RouteDecision("r2", "load", matched_blocks=0))  # a (oldest) dropped
    assert list(p._queues.requests) == ["b", "c"]
    assert p._queues.own == {"r1": [32, 32], "r2": [48, 48]} and p._queues.share == {"r1": 1.0, "r2": 1.0}
    p.on_request_finished(b, "r1")  # failed before its first token
    assert p._queues.own == {"r2": [48, 48]}
    p.on_replica_died("r2")
    assert p._queues.requests == {} and p._queues.own == {} and p._queues.share == {}
    d = p.choose(a, [load("r1", queued=640)], idx)
    assert d.replica_id == "r1"


def test_cache_aware_discounts_blocks_under_eviction_pressure():
    idx = make_index({"r0": list(range(6)), "r1": list(range(5))})
    # Same queued work (10 blocks); r0 has only 10 evictable blocks left (pressure 1).
    reps = [load("r0", queued=160, free=10), load("r1", queued=160, free=1000)]
    req = make_request("q", range(10))
    # fit_first off: r0 has no room beyond its queue, which alone would exclude it.
    d = CacheAwarePolicy(CacheAwareConfig(fit_first=False)).choose(req, reps, idx)
    assert (d.replica_id, d.matched_blocks) == ("r1", 5)  # 96*0.5=48 < 80*(1-0.005)=79.6
    d = CacheAwarePolicy(CacheAwareConfig(evict_weight=0.0, fit_first=False)).choose(req, reps, idx)
    assert (d.replica_id, d.matched_blocks) == ("r0", 6)


def test_cache_aware_fit_first_prefers_room_but_keeps_a_sessions_home():
    idx = make_index({"r0": list(range(38))})
    req = make_request("q", range(40))  # 640 tokens; r0 holds 608 of them
    # r0: free 180 - queue 150 blocks = 30 < 40 needed; r1: 1000 - 125 >= 40. Both are
    # admissible (est r0 32 + 2400/4 = 632, r1 640 + 2000/4 = 1140 <= 2 x 632) and the cost
    # prefers r0 (32 + 2400/4 = 632 < 640 + 2000/4 = 1140; eviction discount off for clarity).
    reps = [load("r0", queued=2400, free=180), load("r1", queued=2000, free=1000)]
    assert CacheAwarePolicy(CacheAwareConfig(evict_weight=0.0, fit_first=False)).choose(req, reps, idx).replica_id == "r0"
    d = CacheAwarePolicy(CacheAwareConfig(evict_weight=0.0)).choose(req, reps, idx)
    assert (d.replica_id, d.reason, d.score) == ("r1", "load", 1140.0)
    # Nobody has room: nothing to prefer, the cost decides as without fit-first.
    full = [load("r0", queued=2400, free=180), load("r1", queued=2000, free=150)]
    assert CacheAwarePolicy(CacheAwareConfig(evict_weight=0.0)).choose(req, full, idx).replica_id == "r0"
    # A session's later turn stays home though home has no room (moving recomputes it).
    p = CacheAwarePolicy(CacheAwareConfig(evict_weight=0.0))
    first = make_request("t1", range(38), session="s")
    p.on_request_routed(first, p.choose(first, [load("r0"), load("r1", out=1)], idx))
    turn = make_request("t2", range(40), session="s")
    d = p.choose(turn, reps, idx)
    assert (d.replica_id, d.reason) == ("r0", "session_home")


def test_cache_aware_follows_in_flight_prefix_until_finished():
    p = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0, track_inflight=True))
    a = make_request("a", range(10))
    reps = [load("r0", out=1), load("r1", out=1), load("r2")]
    da = p.choose(a, reps, EMPTY)
    assert da.replica_id == "r2"
    p.on_request_routed(a, da)
    # Before a's blocks are published, b (same 9-block prefix) follows a to r2:
    # 160 - 144 + 128 (one outstanding request) = 144 < 160 on r0.
    reps = [load("r0"), load("r1"), load("r2", out=1)]
    b = make_request("b", list(range(9)) + [77])
    db = p.choose(b, reps, EMPTY)
    assert (db.replica_id, db.reason, db.matched_blocks, db.score) == ("r2", "inflight_prefix", 9, 144.0)
    p.on_request_finished(a, "r2")
    assert p.choose(b, reps, EMPTY).replica_id == "r0"
    # With in-flight tracking off (the default), b goes by load at once.
    q = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0))
    q.on_request_routed(a, da)
    assert q.choose(b, reps, EMPTY).replica_id == "r0"


@pytest.mark.parametrize("members", [[], ["r0", "r1"]])
def test_cache_aware_churn_spreads_new_prefixes(members):
    """``members``: the live replicas the policy was told of; when every one of them is
    offered, the mean inflow comes from the running total instead of a sum over them."""
    p = CacheAwarePolicy()  # churn_weight 0.5
    p.update_replicas(members)
    reps = [load("r0"), load("r1")]
    a = make_request("a", range(10))
    p.on_request_routed(a, p.choose(a, reps, EMPTY))  # -> r0 (tie by id); 160 new tokens on r0
    # Unrelated prompt: r0's inflow is twice the mean: churn 0.5 * 160 * (2 - 1) = 80 -> r1.
    d = p.choose(make_request("b", range(100, 110)), reps, EMPTY)
    assert (d.replica_id, d.score) == ("r1", 160.0)
    # A 6-block match on r0 (96 tokens) outweighs the 80 tokens of churn.
    idx = make_index({"r0": list(range(6))})
    d = p.choose(make_request("c", list(range(6)) + [50, 51, 52, 53]), reps, idx)
    assert (d.replica_id, d.score) == ("r0", pytest.approx(160 - 96 + 80))
    # Without the churn term the unrelated prompt goes to r0 (tie -> id).
    assert CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0)).choose(make_request("b", range(100, 110)), reps, EMPTY).replica_id == "r0"


def test_cache_aware_sticky_credit_while_the_index_is_stale():
    # The cost path's sticky credit (what decides when session_sticky is off).
    p = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0, session_sticky=False))
    t0 = make_request("t0", range(10), session="s")
    d0 = p.choose(t0, [load("r0", out=1), load("r1"), load("r2", out=1)], EMPTY)
    assert d0.replica_id == "r1"
    p.on_request_routed(t0, d0)
    p.on_request_finished(t0, "r1")
    # Redis is down (empty, never synced index): the next turn extends the prefix and
    # stays on r1 although r0 is now as idle; 0.5 * 10 blocks credited.
    t1 = make_request("t1", range(14), session="s")
    d1 = p.choose(t1, [load("r0"), load("r1"), load("r2")], EMPTY)
    assert (d1.replica_id, d1.reason, d1.matched_blocks) == ("r1", "session_sticky", 5)
    # Another tenant's session "s" is a different session.
    other = make_request("o", range(14), session="s", tenant="t2")
    assert p.choose(other, [load("r0"), load("r1"), load("r2")], EMPTY).replica_id == "r0"
    # A fresh index that says r1 evicted the session's blocks wins over stickiness.
    fresh = make_index({"r0": [], "r1": [], "r2": []})
    assert p.choose(t1, [load("r0"), load("r1"), load("r2")], fresh).replica_id == "r0"
    # The replica dies: the session is forgotten.
    p.on_replica_died("r1")
    d2 = p.choose(t1, [load("r0"), load("r2")], EMPTY)
    assert (d2.replica_id, d2.reason) == ("r0", "load")


def test_cache_aware_index_beats_stale_sticky_credit():
    p = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0, session_sticky=False))
    t0 = make_request("t0", range(10), session="s")
    p.on_request_routed(t0, p.choose(t0, [load("r0"), load("r1", out=1)], EMPTY))  # -> r0
    p.on_request_finished(t0, "r0")
    # r0 is unknown to the index (stale: 0.5 * 10 = 5 blocks credited); r1 holds 9.
    idx = make_index({"r1": list(range(9))})
    d = p.choose(make_request("t1", range(12), session="s"), [load("r0"), load("r1")], idx)
    assert (d.replica_id, d.matched_blocks) == ("r1", 9)


def _routed(p, req, replicas, index):
    d = p.choose(req, replicas, index)
    p.on_request_routed(req, d)
    p.on_request_finished(req, d.replica_id)
    return d


def test_cache_aware_session_goes_home_through_lag_load_and_churn():
    p = CacheAwarePolicy()  # session_sticky on, hold frac 0.5, churn on
    t0 = make_request("t0", range(10), session="s")
    assert _routed(p, t0, [load("r0", out=1), load("r1")], EMPTY).replica_id == "r1"
    # The index is fresh but lags (nothing of the session published yet), r1 is busier
    # and carries all the churn: the session still goes home, unconfirmed.
    lagging = make_index({"r0": [], "r1": []})
    t1 = make_request("t1", range(14), session="s")
    d1 = _routed(p, t1, [load("r0"), load("r1", out=3)], lagging)
    assert (d1.replica_id, d1.reason, d1.matched_blocks) == ("r1", "session_home", 0)
    assert p._sessions[session_key("default", "s")].confirmed is False
    # The index shows 12 of the 14 shared blocks on r1 (>= 0.5 * 14): confirmed.
    idx = make_index({"r0": [], "r1": list(range(12))})
    t2 = make_request("t2", range(18), session="s")
    d2 = _routed(p, t2, [load("r0"), load("r1", out=4)], idx)
    assert (d2.replica_id, d2.reason, d2.matched_blocks) == ("r1", "session_home", 12)
    assert p._sessions[session_key("default", "s")].confirmed is True
    # Another tenant's "s" is another session: no home yet, and the cost alone would pick
    # idle r0, but TTFT admission keeps it where 12 of its 18 blocks are (r0: 288 > 2 x 96).
    other = make_request("o", range(18), session="s", tenant="t2")
    d = p.choose(other, [load("r0"), load("r1", out=4)], idx)
    assert (d.replica_id, d.reason) == ("r1", "index_prefix")
    assert p.choose(other, [load("r0"), load("r1", out=4)], make_index({"r0": [], "r1": []})).replica_id == "r0"


def test_cache_aware_session_leaves_a_dead_overloaded_or_evicted_home():
    def confirmed_on_r1():
        p = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0))
        _routed(p, make_request("t0", range(10), session="s"), [load("r0", out=1), load("r1")], EMPTY)
        _routed(p, make_request("t1", range(12), session="s"), [load("r0"), load("r1")], make_index({"r1": list(range(10))}))
        return p

    t2 = make_request("t2", range(14), session="s")
    # Overloaded beyond TTFT admission: r1's estimate (224 - 192 uncached + 2000 / 4 queued
    # = 532) is above 2 x r0's 224.
    p = confirmed_on_r1()
    held = make_index({"r1": list(range(12))})
    d = p.choose(t2, [load("r0"), load("r1", queued=2000)], held)
    assert (d.replica_id, d.reason) == ("r0", "load")
    # Within it (32 + 1600 / 4 = 432 <= 448) it stays; so it does with 9 requests decoding.
    assert p.choose(t2, [load("r0"), load("r1", queued=1600)], held).reason == "session_home"
    assert p.choose(t2, [load("r0"), load("r1", out=9)], held).reason == "session_home"
    # Evicted: the confirmed session's blocks are gone from a fresh view (5 < 0.5 * 12).
    p = confirmed_on_r1()
    d = p.choose(t2, [load("r0"), load("r1")], make_index({"r0": list(range(12)), "r1": list(range(5))}))
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "index_prefix", 12)
    # 6 of 12 (= 0.5 * 12) still counts as holding the session...
    d = p.choose(t2, [load("r0"), load("r1")], make_index({"r0": [], "r1": list(range(6))}))
    assert (d.replica_id, d.reason) == ("r1", "session_home")
    # ... unless another replica is more than twice as fast by TTFT admission: r0 holds 12
    # (224 - 192 = 32 tokens to compute), r1 6 (128 > 2 x 32).
    d = p.choose(t2, [load("r0"), load("r1")], make_index({"r0": list(range(12)), "r1": list(range(6))}))
    assert (d.replica_id, d.reason) == ("r0", "index_prefix")
    # A stale view cannot tell: home, credited with sticky_trust (0.5) of the shared prefix.
    d = p.choose(t2, [load("r0"), load("r1")], EMPTY)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r1", "session_sticky", 6)
    # Dead: not among the live replicas, and forgotten once reported dead.
    assert p.choose(t2, [load("r0"), load("r2")], EMPTY).replica_id == "r0"
    p.on_replica_died("r1")
    assert not p._sessions
    # A session that moved is unconfirmed on its new replica.
    p = confirmed_on_r1()
    p.on_request_routed(t2, RouteDecision("r0", "load"))
    assert p._sessions[session_key("default", "s")].confirmed is False
    with pytest.raises(ValueError, match="session_hold_frac"):
        CacheAwarePolicy(CacheAwareConfig(session_hold_frac=1.5))


def test_cache_aware_template_home_is_the_ring_owner():
    p = CacheAwarePolicy(CacheAwareConfig(template_trust=0.5, churn_weight=0.0))
    reps = [load("r0"), load("r1"), load("r2")]
    p.update_replicas(["r0", "r1", "r2"])
    b = make_request("b", [500, 501, 502, 503, 9, 9], template_blocks=4)
    # Keyed on the first block (template_key_blocks=1, the default).
    home = reference_owner(["r0", "r1", "r2"], b.block_hashes[0].hex(), 160)
    d = p.choose(b, reps, EMPTY)
    assert (d.replica_id, d.reason, d.matched_blocks) == (home, "template_home", 2)
    # Same template, other suffix: same home. A real longer match elsewhere wins.
    c = make_request("c", [500, 501, 502, 503, 7, 7, 7], template_blocks=4)
    assert p.choose(c, reps, EMPTY).replica_id == home
    other = next(r for r in ["r0", "r1", "r2"] if r != home)
    idx = make_index({other: [500, 501, 502]})
    assert p.choose(c, reps, idx).replica_id == other


def test_cache_aware_template_home_is_an_offered_replica():
    """With every live replica offered the ring's owner is the home; with the owner left
    out (quarantined, or excluded on a retry) the next offered one clockwise is."""
    ids = [f"r{i}" for i in range(4)]
    p = CacheAwarePolicy(CacheAwareConfig(template_trust=2.0, churn_weight=0.0))
    p.update_replicas(ids)
    t = make_request("t", [700, 701, 702, 703, 9], template_blocks=4)
    home = reference_owner(ids, t.block_hashes[0].hex(), 160)
    assert p.choose(t, [load(r) for r in ids], EMPTY).replica_id == home
    offered = [r for r in ids if r != home]
    d = p.choose(t, [load(r) for r in offered], EMPTY)
    assert (d.replica_id, d.reason) == (p.ring.owner(t.block_hashes[0].hex(), set(offered)), "template_home")
    assert d.replica_id in offered


def test_cache_aware_template_key_blocks_sets_the_ring_key():
    reps = [load(f"r{i}") for i in range(8)]
    ids = [r.replica_id for r in reps]
    grown = make_request("g", [600, 601, 602, 603, 9], template_blocks=4)
    # key_blocks=1: the home stays put while the template's known extent grows 1 -> 4.
    p = CacheAwarePolicy(CacheAwareConfig(template_trust=2.0, churn_weight=0.0, template_key_blocks=1))
    p.update_replicas(ids)
    home1 = reference_owner(ids, grown.block_hashes[0].hex(), 160)
    for tb in (1, 4):
        d = p.choose(make_request(f"t{tb}", [600, 601, 602, 603, 9], template_blocks=tb), reps, EMPTY)
        assert (d.replica_id, d.reason) == (home1, "template_home")
    # key_blocks=0: keyed on the template's last block, so the home follows its extent.
    p0 = CacheAwarePolicy(CacheAwareConfig(template_trust=2.0, churn_weight=0.0, template_key_blocks=0))
    p0.update_replicas(ids)
    for tb in (1, 4):
        want = reference_owner(ids, grown.block_hashes[tb - 1].hex(), 160)
        d = p0.choose(make_request(f"u{tb}", [600, 601, 602, 603, 9], template_blocks=tb), reps, EMPTY)
        assert (d.replica_id, d.reason) == (want, "template_home")


def test_cache_aware_session_footprint_steers_other_work_away():
    p = CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0, session_sticky=False))  # footprint_weight 0.5, window 96
    reps = [load("r0", cap=100), load("r1", cap=100)]
    s0 = make_request("s0", range(40), session="s")
    d0 = p.choose(s0, reps, EMPTY)
    assert d0.replica_id == "r0"  # no footprint yet: tie -> id
    p.on_request_routed(s0, d0)
    assert p._footprint.as_dict() == pytest.approx({"r0": 40.0})
    # Unrelated 10-block prompt: r0 costs 160 + 0.5 * 160 * 40/100 = 192, r1 160.
    b = make_request("b", range(100, 110))
    assert (p.choose(b, reps, EMPTY).replica_id, p.choose(b, reps, EMPTY).score) == ("r1", 160.0)
    assert CacheAwarePolicy(CacheAwareConfig(churn_weight=0.0, footprint_weight=0.0)).choose(b, reps, EMPTY).replica_id == "r0"
    # Unknown capacity (0): no footprint term.
    assert p.choose(b, [load("r0", cap=0), load("r1", cap=0)], EMPTY).replica_id == "r0"
    # The session's own footprint does not count against its next turn: 720 - 640 = 80.
    idx = make_index({"r0": list(range(40))})
    s1 = make_request("s1", range(45), session="s")
    d1 = p.choose(s1, reps, idx)
    assert (d1.replica_id, d1.score) == ("r0", 80.0)
    # Every routed request decays the footprint by 1 - 1/96.
    p.on_request_routed(b, RouteDecision("r1", "load"))
    assert p._footprint.get("r0") == pytest.approx(40 * 95 / 96)
    # The next turn replaces the session's share (here on r1: r0 drops to 0).
    p.on_request_routed(s1, RouteDecision("r1", "load"))
    assert p._footprint.get("r0") == pytest.approx(0.0, abs=1e-9)
    assert p._footprint.get("r1") == pytest.approx(45.0)


def test_cache_aware_forgotten_sessions_leave_the_footprint():
    p = CacheAwarePolicy(CacheAwareConfig(max_sessions=1))
    p.on_request_routed(make_request("a", range(10), session="a"), RouteDecision("r0", "load"))
    p.on_request_routed(make_request("b", range(100, 105), session="b"), RouteDecision("r0", "load"))
    # Session a was dropped by the bound: only b's 5 blocks remain on r0.
    assert list(p._sessions) == [session_key("default", "b")]
    assert p._footprint.get("r0") == pytest.approx(5.0)
    p.on_replica_died("r0")
    assert p._footprint.as_dict() == {} and not p._sessions


def test_cache_aware_update_replicas_drops_state_of_departed():
    p = CacheAwarePolicy()
    a = make_request("a", range(4), session="s", template_blocks=2)
    p.on_request_routed(a, p.choose(a, [load("r0")], EMPTY))
    p.update_replicas(["r1"])
    assert p._pending == {} and p._sessions == {} and p._inflow.as_dict() == {} and p._inflight == {}
    assert p.ring.members == {"r1"}
    d = p.choose(make_request("b", range(4), session="s", template_blocks=2), [load("r0", out=1), load("r1")], EMPTY)
    assert d.replica_id == "r1"


def test_common_prefix_blocks():
    assert common_prefix_blocks(hashes(1, 2, 3, 4), hashes(1, 2, 9)) == 2
    assert common_prefix_blocks(hashes(1, 2), hashes(1, 2, 3)) == 2
    assert common_prefix_blocks(hashes(5), hashes(1)) == 0
    assert common_prefix_blocks([], hashes(1)) == 0


def test_index_is_stale_until_synced_and_after_a_gap():
    idx = LocalityIndex()
    assert idx.is_stale("r0")  # never synced
    idx.apply_summary("r0", epoch=1, seq=0, block_hashes=hashes(1, 2))
    assert not idx.is_stale("r0")
    assert idx.apply_events("r0", 1, 2, hashes(1, 2, 3), []) is False  # seq gap
    assert idx.is_stale("r0")


def test_cache_aware_counts_a_host_match_at_its_promotion_cost():
    """r0: GPU blocks 1-2 and host blocks 3-8 of the prompt; r1: GPU blocks 1-5.
    r0's hit = 16 * (2 + (1 - host_cost) * 6); r1's = 16 * 5 = 80."""
    idx = make_index({"r0": [1, 2], "r1": [1, 2, 3, 4, 5]})
    idx.apply_events_unchecked("r0", [], [], host_stored=hashes(*range(1, 9))[2:])
    req = make_request("q", range(1, 11))
    reps = [load("r0"), load("r1")]
    d = CacheAwarePolicy().choose(req, reps, idx)  # host_cost 0.08: 160 - 16 * 7.52
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "host_prefix", 8)
    assert d.score == pytest.approx(160 - 16 * (2 + 0.92 * 6))
    d = CacheAwarePolicy(CacheAwareConfig(host_cost=0.75)).choose(req, reps, idx)  # r0: 160 - 56 = 104 > 80
    assert (d.replica_id, d.reason, d.score) == ("r1", "index_prefix", pytest.approx(80))
    d = CacheAwarePolicy(CacheAwareConfig(host_cost=1.0)).choose(req, reps, idx)  # the host tier ignored
    assert (d.replica_id, d.matched_blocks) == ("r1", 5)
    with pytest.raises(ValueError, match="host_cost"):
        CacheAwarePolicy(CacheAwareConfig(host_cost=1.5))


def test_cache_aware_counts_gpu_blocks_after_host_blocks_as_full_hits():
    """r0: GPU blocks 1-2, host 3-6, GPU 7-8 again (their parents were demoted first):
    its store would share 7-8 and promote 3-6, so hit = 16 * (2 + 2 + 0.92 * 4) = 16 * 7.68
    against r1's GPU blocks 1-6 (16 * 6). Counting only the host blocks right after the
    GPU prefix (16 * 5.68) chose r1."""
    h = hashes(*range(1, 11))
    idx = make_index({"r1": list(range(1, 7))})
    idx.apply_events_unchecked("r0", [h[0], h[1], h[6], h[7]], [], host_stored=h[2:6])
    assert idx.tier_runs(h, idx.prefix_matches(h))["r0"] == (6, (6, 7))
    req = make_request("q", range(1, 11))
    d = CacheAwarePolicy().choose(req, [load("r0"), load("r1")], idx)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "host_prefix", 8)
    assert d.score == pytest.approx(160 - 16 * (4 + 0.92 * 4))


def test_sglang_roots_follow_inserts_evictions_and_departures():
    from unicache.router.routing.baselines.sglang import SGLangPolicy

    p = SGLangPolicy(max_tree_tokens=3 * 16)
    p.update_replicas(["r0", "r1"])
    a, b = hashes(1, 2), hashes(5, 6)
    p.tree("r0").insert(a, tick=1)
    p.tree("r1").insert(a, tick=2)
    p.tree("r1").insert(b, tick=3)
    assert p._roots == {a[0]: {"r0", "r1"}, b[0]: {"r1"}}
    p.tree("r1").evict_to(1)  # a's tail, a's root, b's tail go: b's root stays
    assert p._roots == {a[0]: {"r0"}, b[0]: {"r1"}}
    p.on_replica_died("r0")
    assert p._roots == {b[0]: {"r1"}}
    p.update_replicas([])
    assert p._roots == {} and p.trees == {}


def test_hash_ring_joins_one_at_a_time_equal_one_rebuild():
    from unicache.router.routing.keys import HashRing, ring_hash

    ids = [f"r{i}" for i in range(40)]
    one_by_one, at_once, grown = HashRing(16), HashRing(16), HashRing(16)
    for rid in ids:
        one_by_one.add(rid)
        assert one_by_one.owner("k") is not None  # rebuilt between joins too
    at_once.set_members(ids)
    grown.set_members(ids[:30])
    assert grown.owner("k") is not None
    grown.set_members(ids)
    expected = sorted((ring_hash(f"{r}#{i}"), r) for r in ids for i in range(16))
    assert one_by_one.points() == at_once.points() == grown.points() == expected
    grown.set_members(ids[5:])
    assert grown.points() == sorted((ring_hash(f"{r}#{i}"), r) for r in ids[5:] for i in range(16))
    assert set(grown._cached) == set(ids[5:])


def test_cache_aware_queue_per_lane_counts_the_queue_over_the_prefill_lanes():
    # r0 holds 8 of the 10 blocks (128 of 160 tokens) and has 200 queued tokens, r1 nothing.
    idx = make_index({"r0": list(range(8))})
    reps = [load("r0", queued=200), load("r1")]
    req = make_request("a", range(10))
    kw = {"churn_weight": 0.0, "footprint_weight": 0.0, "evict_weight": 0.0, "queue_share": False}
    # whole queue: r0 costs 160 - 128 + 200 = 232 > r1's 160
    d = CacheAwarePolicy(CacheAwareConfig(queue_per_lane=False, **kw)).choose(req, reps, idx)
    assert (d.replica_id, d.score) == ("r1", 160.0)
    # over 4 lanes: r0 costs 32 + 50 = 82
    d = CacheAwarePolicy(CacheAwareConfig(queue_per_lane=True, **kw)).choose(req, reps, idx)
    assert (d.replica_id, d.reason, d.score) == ("r0", "index_prefix", 82.0)
    d = CacheAwarePolicy(CacheAwareConfig(queue_per_lane=True, prefill_lanes=2, **kw)).choose(req, reps, idx)
    assert (d.replica_id, d.score) == ("r0", 132.0)
