"""Blocks routed and not yet confirmed by events count in the view policies read."""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.pending import PendingBlocks, PendingView
from unicache.router.cluster.view import ClusterView, EmptyView
from unicache.router.routing.base import ReplicaLoad, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy


class Clock:
    def __init__(self):
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


H = hash_id_blocks(list(range(8)))


def test_pending_extends_matches_until_confirmed_removed_or_aged_out():
    clock = Clock()
    p = PendingBlocks(ttl_s=5.0, clock=clock)
    p.add("r1", H[:6])
    assert p.extend({}, H) == {"r1": 6}
    assert p.extend({"r1": 2, "r2": 3}, H) == {"r1": 6, "r2": 3}
    p.confirm("r1", H[:2])  # the index holds them now: still a run from its match of 2
    assert p.extend({"r1": 2}, H) == {"r1": 6}
    p.drop("r1", [H[3]])  # evicted: the run stops before it
    assert p.extend({"r1": 2}, H) == {"r1": 3} and p.extend({}, H) == {}
    clock.t += 5.0
    assert p.extend({"r1": 2}, H) == {"r1": 2}  # aged out
    p.add("r2", H[:1])  # an add drops the expired ones at the front
    assert len(p) == 1 and p._holders == {H[0]: {"r2"}}
    p.drop_replica("r2")
    assert len(p) == 0 and not p


def test_pending_is_bounded_per_replica_oldest_first():
    p = PendingBlocks(max_per_replica=4, clock=Clock())
    p.add("r1", H[:6])
    assert list(p._by_replica["r1"]) == list(H[2:6]) and p.extend({}, H) == {}
    assert p.extend({"r1": 2}, H) == {"r1": 6}


def test_a_view_over_an_empty_index_still_sees_what_was_routed():
    p = PendingBlocks(clock=Clock())
    p.add("r1", H[:3])
    view = PendingView(EmptyView(), p)
    assert view.prefix_matches(H) == {"r1": 3} and view.match("r1", H) == 3 and view.match("r2", H) == 0
    assert view.is_stale("r1")  # as the empty view says: policies may trust their session memory


def test_groups_of_a_large_fleet_release_a_replica_with_pending_blocks():
    idx = LocalityIndex()
    for r in ("a", "b", "c", "d"):
        idx.apply_events_unchecked(r, H[:2], [])
    p = PendingBlocks(clock=Clock())
    p.add("c", H[:5])
    deep, groups = PendingView(idx, p).prefix_match_groups(H, 1)
    assert deep == {"c": 5} and groups == [(2, {"a", "b", "d"})]


def _request(rid: str, n: int, session: str | None = None) -> RoutingRequest:
    hs = H[:n]
    cls = RequestClass(tenant="t", session_id=session, task=Task.CHAT if session else Task.OTHER)
    return RoutingRequest(rid, cls, hs, n * 16, 16)


def test_a_next_turn_right_after_dispatch_finds_its_home_before_any_event_and_with_redis_down():
    """A chat's second turn, no session id (the policy knows none), sent before the first
    turn's events arrive: the pending blocks send it where its prefix is."""
    idx = LocalityIndex()
    cluster = ClusterView(CacheAwarePolicy(), idx)
    for r in ("r1", "r2"):
        cluster.upsert(r, f"addr-{r}", static=True)
    cluster.redis_connected = True
    loads = [ReplicaLoad("r1", free_blocks=100, capacity_blocks=100), ReplicaLoad("r2", free_blocks=100, capacity_blocks=100)]
    first = _request("q1", 4)
    d1 = cluster.policy.choose(first, loads, cluster.locality())
    cluster.pending.add(d1.replica_id, first.block_hashes)
    other = "r2" if d1.replica_id == "r1" else "r1"
    loads = [ReplicaLoad(d1.replica_id, free_blocks=100, capacity_blocks=100, running=1, in_flight=1),
             ReplicaLoad(other, free_blocks=100, capacity_blocks=100)]
    d2 = cluster.policy.choose(_request("q2", 6), loads, cluster.locality())
    assert (d2.replica_id, d2.reason, d2.matched_blocks) == (d1.replica_id, "index_prefix", 4)
    cluster.redis_connected = False  # Redis restarts: the index is not fed
    d3 = cluster.policy.choose(_request("q3", 6), loads, cluster.locality())
    assert (d3.replica_id, d3.matched_blocks) == (d1.replica_id, 4)
    # the events arrive: confirmed into the index, no longer pending
    idx.apply_events_unchecked(d1.replica_id, first.block_hashes, [])
    assert len(cluster.pending) == 0
    cluster.remove(d1.replica_id)
    assert cluster.pending.extend({}, H) == {}


def test_ttl_and_bound_must_be_positive():
    with pytest.raises(ValueError):
        PendingBlocks(ttl_s=0)
