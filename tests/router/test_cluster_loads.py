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


def test_a_report_forgets_our_requests_as_they_end_until_the_next_one():
    """A /metrics scrape (every 5 s by default) saw 3 running and 1 waiting with 3 of our
    requests in flight: as those end they come off its counts, so a stale scrape does not
    keep the backend looking busy; a request sent after the scrape takes nothing off."""
    cv = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    cv.upsert("v", "http://127.0.0.1:1")
    for _ in range(3):
        cv.started("v")
    cv.set_external_load("v", 3, 1, 10, 100)
    cv.started("v")  # after the scrape: not in its counts
    load = cv.replicas["v"].load
    assert (load.running, load.waiting, load.in_flight, load.outstanding) == (3, 1, 4, 4)
    cv.finished("v")
    cv.finished("v")
    assert (load.running, load.waiting, load.outstanding) == (1, 1, 2)
    cv.finished("v")
    cv.finished("v")  # the one sent after the scrape: the waiting one is another router's
    assert (load.running, load.waiting, load.in_flight, load.outstanding) == (0, 1, 0, 1)
    cv.set_external_load("v", 2, 0, 10, 100)  # a new scrape is taken as it is
    assert (load.running, load.waiting) == (2, 0)
    cv.started("v")
    cv.finished("v")
    assert (load.running, load.waiting) == (2, 0)


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
    at_beat: dict[str, int] = {}  # rid -> our requests in flight when its last heartbeat came
    ended: dict[str, int] = {}  # rid -> our requests ended since
    for op, rid, k in ops:
        before = cv.replicas[rid].in_flight if rid in cv.replicas else 0
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
        if op in ("beat", "restart"):
            at_beat[rid], ended[rid] = cv.replicas[rid].in_flight, 0
        elif op == "finish" and before > 0:
            ended[rid] = ended.get(rid, 0) + 1
        elif op == "remove":
            at_beat.pop(rid, None)
        got = cv.loads()
        recs = [cv.replicas[r] for r in sorted(cv.replicas) if not cv.replicas[r].quarantined]
        assert [id(x) for x in got] == [id(r.load) for r in recs]

        def reported(r):
            """The heartbeat's running and waiting less our requests it counted that ended since."""
            hb = r.heartbeat
            gone = min(ended.get(r.replica_id, 0), at_beat.get(r.replica_id, 0))
            off_running = min(gone, hb.running)
            return hb.running - off_running, max(0, hb.waiting - (gone - off_running))

        expected = [(r.replica_id, *((*reported(r), r.heartbeat.queued_prefill_tokens, r.heartbeat.cache.free_blocks)
                                     if r.heartbeat is not None else (0, 0, 0, 0)),
                     r.in_flight + r.peer_in_flight) for r in recs]
        assert view(got) == expected
        assert [x.capacity_blocks for x in got] == [r.heartbeat.cache.capacity_blocks if r.heartbeat is not None else 0 for r in recs]
        assert cv.loads() is got  # kept until something changes


def test_a_vllm_servers_queued_prompt_tokens_are_the_routers_own_without_a_first_token():
    """vLLM reports no queue of prompt tokens: the router counts its requests' from
    dispatch to their first token (or their end without one); a replica's come from its
    heartbeat and are left alone."""
    cv = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    cv.upsert("v", "http://127.0.0.1:1")
    cv.upsert("r", "h:1", beat("r", 0, 10))
    cv.started("v", 700)
    cv.started("v", 300)
    cv.started("r", 500)
    load = cv.replicas["v"].load
    assert (load.queued_prefill_tokens, cv.replicas["r"].load.queued_prefill_tokens) == (1000, 7)
    cv.prefilled("v", 700)  # its first token
    cv.prefilled("r", 500)
    assert (load.queued_prefill_tokens, cv.replicas["r"].load.queued_prefill_tokens) == (300, 7)
    cv.set_external_load("v", 2, 0, 10, 100)  # a scrape does not touch it
    assert load.queued_prefill_tokens == 300
    cv.prefilled("v", 300)
    cv.prefilled("v", 300)  # never below 0
    assert load.queued_prefill_tokens == 0
