"""Routers that share terms decide as one router would.

Two ``cache_aware`` policies A and B take turns at one request stream; after each request
the router that routed it hands its routed events to the other (``take_routed`` /
``apply_routed``) and writes the session's record to a shared store, which the next turn's
router imports first (what ``terms_exchange`` and ``session_store`` do through Redis). A
third policy C routes the whole stream alone. With the exchange after every request (the
events, and the other router's queued sums before each decision), A's and B's decisions,
churn inflow and session footprint must equal C's at every step; without the events
(sessions still shared) they drift apart, so the test can tell (without the queued sums
alone, 8-11 of 300 decisions differ).
"""

from __future__ import annotations

import random

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RoutedEvent, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy
from unicache.router.routing.keys import session_key

BS = 16
REPLICAS = ["r0", "r1", "r2"]


def stream(seed: int, n: int) -> list[RoutingRequest]:
    """Sessions whose turns grow their prompt, between one-off prompts."""
    rng = random.Random(seed)
    prompts: dict[int, list[int]] = {}
    out = []
    for i in range(n):
        if rng.random() < 0.6:
            s = rng.randrange(8)
            ids = prompts.setdefault(s, [10_000 * (s + 1)])
            ids += [rng.randrange(10**9) for _ in range(rng.randint(1, 4))]
            cls = RequestClass(session_id=f"s{s}", task=Task.CHAT)
        else:
            ids = [rng.randrange(10**9) for _ in range(rng.randint(1, 6))]
            cls = RequestClass(task=Task.OTHER)
        hs = hash_id_blocks(list(ids))
        out.append(RoutingRequest(f"q{i}", cls, hs, len(hs) * BS + 3, BS))
    return out


def loads(step: int = 0, replicas: list[str] = REPLICAS) -> list[ReplicaLoad]:
    """The replicas' published loads at a step: queues that come and go, so the queue
    share (what part of a queue the routers' waiting requests say is cached) matters."""
    return [ReplicaLoad(r, free_blocks=40, capacity_blocks=40, queued_prefill_tokens=48 * ((step + k) % 3))
            for k, r in enumerate(replicas)]


def replay(exchange: bool, seed: int = 0, n: int = 300, replicas: list[str] = REPLICAS):
    """Route the stream through A/B (alternating) and through C; return the steps where
    they decided differently and the largest term differences seen."""
    a, b, c = CacheAwarePolicy(), CacheAwarePolicy(), CacheAwarePolicy()
    if exchange:
        assert a.share_terms() and b.share_terms()
    else:
        a.share_terms(), b.share_terms()  # the same session import path, events dropped
    store: dict[str, object] = {}
    index = LocalityIndex()
    differ, max_gap = [], 0.0
    waiting: list[tuple[RoutingRequest, CacheAwarePolicy, str, str]] = []  # first tokens 3 requests later
    for i, req in enumerate(stream(seed, n)):
        x, y = (a, b) if i % 2 == 0 else (b, a)
        key = session_key(req.cls.tenant, req.cls.session_id) if req.cls.session_id else None
        if key in store:
            x.import_session(key, store[key])
        if exchange:
            x.set_peer_queued(y.queued_tokens())
        dx = x.choose(req, loads(i, replicas), index)
        dc = c.choose(req, loads(i, replicas), index)
        if (dx.replica_id, dx.reason, dx.matched_blocks) != (dc.replica_id, dc.reason, dc.matched_blocks):
            differ.append(i)
        x.on_request_routed(req, dx)
        c.on_request_routed(req, dc)
        waiting.append((req, x, dx.replica_id, dc.replica_id))
        if len(waiting) > 3:
            first, sender, rx, rc = waiting.pop(0)
            sender.on_first_token(first, rx)
            c.on_first_token(first, rc)
        if key:
            store[key] = x.export_session(key)
        events = x.take_routed()
        assert len(events) == 1 and events[0].replica_id == dx.replica_id
        if exchange:
            y.apply_routed(events)
        for p in (x, y):
            for mine, alone in ((p._inflow.as_dict(), c._inflow.as_dict()), (p._footprint.as_dict(), c._footprint.as_dict())):
                for r in set(mine) | set(alone):
                    max_gap = max(max_gap, abs(mine.get(r, 0.0) - alone.get(r, 0.0)))
        index.apply_events_unchecked(dc.replica_id, req.block_hashes, [])  # the replica caches it
    return differ, max_gap


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_routers_sharing_terms_decide_and_count_as_one_router(seed):
    differ, max_gap = replay(exchange=True, seed=seed)
    assert differ == [] and max_gap == pytest.approx(0.0, abs=1e-6)


def test_in_a_fleet_above_the_candidate_window_too():
    """48 replicas: each decision weighs a window of the fleet drawn from the decision
    clock, which the exchange keeps equal to one router's."""
    fleet = [f"r{i:02d}" for i in range(48)]
    assert CacheAwarePolicy()._window.applies(len(fleet))
    differ, max_gap = replay(exchange=True, seed=3, replicas=fleet)
    assert differ == [] and max_gap == pytest.approx(0.0, abs=1e-6)
    assert replay(exchange=False, seed=3, replicas=fleet)[0]


def test_without_the_events_the_routers_drift_from_one_router():
    differ, max_gap = replay(exchange=False)
    assert differ and max_gap > 100.0


def test_events_say_what_the_decision_did():
    """A session's second turn on another replica: its event takes the first turn's
    decayed share out where it went and adds the new turn's blocks."""
    p = CacheAwarePolicy(CacheAwareConfig(footprint_window=4))
    assert p.take_routed() == [] and p.share_terms()
    first, second = stream(3, 1)[0], None
    cls = first.cls
    hs = first.block_hashes
    p.on_request_routed(first, _decision("r0", 0))
    second = RoutingRequest("q2", cls, hs + hash_id_blocks([7, 8]), (len(hs) + 2) * BS, BS)
    p.on_request_routed(second, _decision("r1", len(hs)))
    got = p.take_routed()
    assert got == [
        RoutedEvent("r0", first.num_prompt_tokens, len(hs)),
        RoutedEvent("r1", 2 * BS, len(hs) + 2, "r0", pytest.approx(len(hs) * 0.75)),
    ]
    assert p.take_routed() == []
    assert p.export_session(session_key(cls.tenant, cls.session_id)).routed_at == 2


def _decision(rid: str, matched: int):
    from unicache.router.routing.base import RouteDecision

    return RouteDecision(rid, "load", matched_blocks=matched)


def test_a_batch_of_events_applies_as_the_events_one_by_one():
    """``apply_routed`` decays once per batch; the terms equal applying each event alone
    (no footprint clamp binds here)."""
    src = CacheAwarePolicy()
    src.share_terms()
    index = LocalityIndex()
    for req in stream(5, 80):
        d = src.choose(req, loads(), index)
        src.on_request_routed(req, d)
    events = src.take_routed()
    one, batch = CacheAwarePolicy(), CacheAwarePolicy()
    for p in (one, batch):
        p.share_terms()
    for ev in events:
        one.apply_routed([ev])
    for start in range(0, len(events), 17):
        batch.apply_routed(events[start:start + 17])
    assert one._routed == batch._routed == len(events) == 80
    assert batch._inflow.as_dict() == pytest.approx(one._inflow.as_dict(), rel=1e-12)
    assert batch._footprint.as_dict() == pytest.approx(one._footprint.as_dict(), rel=1e-12)
    assert one._inflow.as_dict() == pytest.approx(src._inflow.as_dict(), rel=1e-12) and one._footprint.as_dict() == pytest.approx(src._footprint.as_dict(), rel=1e-12)
