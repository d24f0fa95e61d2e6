"""ClusterView.loads hands out each record's kept ReplicaLoad: it must say what the
latest heartbeat and the router's in-flight count say, by replica id, every time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.registry import make_routing_policy
from unicache.v1 import cache_pb2, common_pb2


def beat(rid: str, running: int, free: int) -> cache_pb2.Heartbeat:
    return cache_pb2.Heartbeat(replica_id=rid, address="x", running=running, waiting=1, queued_prefill_tokens=7,
                               cache=common_pb2.CacheState(replica_id=rid, capacity_blocks=100, free_blocks=free))


def view(loads):
    return [(l.replica_id, l.running, l.waiting, l.queued_prefill_tokens, l.free_blocks, l.in_flight) for l in loads]


def test_loads_follow_heartbeats_in_flight_membership_and_quarantine():
    cv = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    cv.upsert("b", "h:2", beat("b", 3, 50))
    cv.upsert("a", "h:1")  # static, no heartbeat yet
    assert view(cv.loads()) == [("a", 0, 0, 0, 0, 0), ("b", 3, 1, 7, 50, 0)]
    cv.started("b")
    cv.started("b")
    cv.finished("b")
    cv.upsert("a", "h:1", beat("a", 5, 20))
    assert view(cv.loads()) == [("a", 5, 1, 7, 20, 0), ("b", 3, 1, 7, 50, 1)]
    cv.upsert("b", "h:2", beat("b", 0, 90))  # a new beat keeps the router's own count
    assert view(cv.loads({"a"})) == [("b", 0, 1, 7, 90, 1)]
    cv.quarantine("a")
    assert [l.replica_id for l in cv.loads()] == ["b"]
    assert [l.replica_id for l in cv.loads(quarantined=True)] == ["a"]
    cv.remove("b")
    cv.upsert("c", "h:3", beat("c", 1, 10))
    assert [l.replica_id for l in cv.all_loads()] == ["a", "c"]
    assert [l.replica_id for l in cv.loads()] == ["c"]


def test_total_in_flight_is_the_sum_over_the_replicas_still_known():
    cv = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    cv.upsert("a", "h:1")
    cv.upsert("b", "h:2")
    for rid in ("a", "a", "b", "b", "b"):
        cv.started(rid)
    cv.finished("a")
    cv.finished("zz")  # unknown: nothing moves
    assert cv.total_in_flight() == 4 == sum(r.in_flight for r in cv.replicas.values())
    cv.remove("b")  # its three requests leave the count now; their ends find no record
    assert cv.total_in_flight() == 1
    cv.finished("b")
    cv.finished("a")
    cv.finished("a")  # never below 0
    assert cv.total_in_flight() == 0
    cv.upsert("b", "h:2")
    cv.started("b")
    assert cv.total_in_flight() == 1 == cv.replicas["b"].in_flight


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["beat", "static", "remove", "quarantine", "release", "start", "finish",
                                               "restart", "peers"]),
                              st.sampled_from(["a", "b", "c"]), st.integers(0, 3)), max_size=60))
def test_kept_loads_list_is_always_what_a_fresh_filter_gives(ops):
    """``loads()`` keeps its list between calls; after any sequence of membership,
    heartbeat, quarantine, in-flight and peer-count changes it must hold exactly the
    healthy replicas' current load objects, by id, with the fields their records say."""
    cv = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    for op, rid, k in ops:
        if op == "beat":
            cv.upsert(rid, f"h:{rid}", beat(rid, k, 10 * k))
        elif op == "static":
            cv.upsert(rid, f"h:{rid}")
        elif op == "restart":
            cv.upsert(rid, f"h:{rid}:{k}", beat(rid, k, k))  # a new address releases a quarantine
        elif op == "remove":
            cv.remove(rid)
        elif op == "quarantine":
            cv.quarantine(rid)
        elif op == "release":
            cv.probe_succeeded(rid)
        elif op == "start":
            cv.started(rid)
        elif op == "finish":
            cv.finished(rid)
        else:
            cv.set_peer_in_flight({rid: k})
        got = cv.loads()
        recs = [cv.replicas[r] for r in sorted(cv.replicas) if not cv.replicas[r].quarantined]
        assert [id(x) for x in got] == [id(r.load) for r in recs]
        expected = [(r.replica_id, *((r.heartbeat.running, r.heartbeat.waiting, r.heartbeat.queued_prefill_tokens,
                                      r.heartbeat.cache.free_blocks) if r.heartbeat is not None else (0, 0, 0, 0)),
                     r.in_flight + r.peer_in_flight) for r in recs]
        assert view(got) == expected
        assert [x.capacity_blocks for x in got] == [r.heartbeat.cache.capacity_blocks if r.heartbeat is not None else 0 for r in recs]
        assert cv.loads() is got  # kept until something changes
