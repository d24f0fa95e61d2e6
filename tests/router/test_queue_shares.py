"""``QueueShares``: per-replica queued prompt tokens of one router and the shares they give."""

from __future__ import annotations

from unicache.router.routing.cache_aware.queue_share import QueueShares


def test_sums_shares_bound_peers_and_departures():
    q = QueueShares(max_requests=2)
    assert q.take_changes() == {}  # not tracked: a lone router keeps no change set
    q.track_changes()
    q.add("a", "r0", 16, 64)
    q.add("b", "r1", 0, 32)
    assert (q.own, q.share) == ({"r0": [16, 64], "r1": [0, 32]}, {"r0": 0.25, "r1": 0.0})
    q.add("a", "r1", 32, 32)  # a retry replaces the earlier attempt
    assert (q.own, q.share) == ({"r1": [32, 64]}, {"r1": 0.5})
    q.add("c", "r2", 8, 8)  # over the bound: the oldest ("b") goes
    assert list(q.requests) == ["a", "c"] and q.own == {"r1": [32, 32], "r2": [8, 8]}
    assert q.take_changes() == {"r0": (0, 0), "r1": (32, 32), "r2": (8, 8)} and q.take_changes() == {}
    share = q.share
    q.set_peer({"r1": (0, 96), "r3": (10, 40)})
    assert q.share is share and share == {"r1": 32 / 128, "r2": 1.0, "r3": 0.25}
    q.drop_replica("r1")
    assert (q.own, q.peer, q.share) == ({"r2": [8, 8]}, {"r3": (10, 40)}, {"r2": 1.0, "r3": 0.25})
    assert q.replicas() == {"r2", "r3"} and q.own_sums() == {"r2": (8, 8)}
    q.remove("c")
    q.remove("nope")
    assert (q.requests, q.own, q.share) == ({}, {}, {"r3": 0.25})
