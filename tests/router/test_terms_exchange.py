"""The terms exchange through a real redis-server: what one router routed reaches the
other's policy; forged, replayed, oversized and unknown-replica input is refused and
counted; an outage keeps the unsent events for the next round."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.contract.state_auth import StateSigner, parse_cluster_key
from unicache.router.cluster.terms_exchange import TermsExchange
from unicache.router.routing.base import RouteDecision, RoutedEvent, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
from unicache.testing.signed_state import CLUSTER_KEY
from unicache.v1 import router_pb2

KEY = parse_cluster_key(CLUSTER_KEY)
PREFIX = "terms"
KNOWN = {"r0", "r1"}.__contains__


def routed(policy: CacheAwarePolicy, rid: str, ids: list[int], session: str | None = None, matched: int = 0) -> None:
    hs = hash_id_blocks(ids)
    cls = RequestClass(session_id=session, task=Task.CHAT if session else Task.OTHER)
    policy.on_request_routed(RoutingRequest(f"q{ids[0]}", cls, hs, 16 * len(hs), 16), RouteDecision(rid, "load", matched))


@pytest.fixture
async def clients(redis_server):
    made = [aioredis.from_url(redis_server.url) for _ in range(3)]
    try:
        yield made
    finally:
        for c in made:
            await c.aclose()


async def test_what_one_router_routes_reaches_the_other(clients):
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    a = TermsExchange(clients[0], PREFIX, KEY, pa, KNOWN, router_id="a")
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b")
    await b.read(1)  # b's stream position: the end, before a writes
    routed(pa, "r0", [1, 2, 3], session="s")
    routed(pa, "r1", [4, 5])
    routed(pa, "r1", [1, 2, 3, 6], session="s", matched=0)  # the session moves to r1
    await a.step()
    await b.read(1)
    assert (a.sent_batches, a.sent_events, b.applied_batches, b.applied_events) == (1, 3, 1, 3)
    assert pb._inflow.as_dict() == pytest.approx(pa._inflow.as_dict()) and pb._footprint.as_dict() == pytest.approx(pa._footprint.as_dict())
    assert pb._routed == pa._routed == 3
    await a.read(1)  # its own batch is skipped
    assert a.applied_batches == 0 and pa._routed == 3


async def test_forged_replayed_oversized_and_unknown_input_is_refused(clients):
    pb = CacheAwarePolicy()
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b", max_batch_events=2)
    await b.read(1)
    writer = TermsExchange(clients[0], PREFIX, KEY, CacheAwarePolicy(), KNOWN, router_id="w")
    stream = writer.stream
    good = writer.encode([RoutedEvent("r0", 100), RoutedEvent("evil", 10**9), RoutedEvent("r1", 5, 2, "r0", float("nan"))])
    other_key = StateSigner(parse_cluster_key("ab" * 16)).seal("routed", router_pb2.RoutedBatch(router_id="x", seq=1).SerializeToString())
    small = writer.encode([RoutedEvent("r1", 7)])
    for raw in (other_key, b"garbage", good, small, small):  # the last one a replay
        await clients[0].xadd(stream, {"b": raw})
    await b.read(1)
    # garbage, the other key's batch, the oversized batch (3 > 2 events) and the replay
    assert b.rejected == 4 and b.applied_batches == 1 and pb._inflow.as_dict() == {"r1": 7.0}
    b.max_batch_events = 10
    late = writer.encode([RoutedEvent("r0", 100), RoutedEvent("evil", 10**9), RoutedEvent("r1", 5, 2, "r0", float("nan"))])
    await clients[0].xadd(stream, {"b": late})
    await b.read(1)
    assert b.dropped_events == 2 and "evil" not in pb._inflow and pb._inflow.get("r0") == 100.0


async def test_an_outage_keeps_the_events_for_the_next_round(redis_server, clients):
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    a = TermsExchange(clients[0], PREFIX, KEY, pa, KNOWN, router_id="a", timeout_s=0.5)
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b", timeout_s=0.5)
    await b.read(1)
    redis_server.stop()
    routed(pa, "r0", [1, 2])
    await a.step()
    assert a.errors >= 1 and a.sent_batches == 0 and len(a._pending) == 1
    redis_server.start()
    routed(pa, "r1", [3])
    for _ in range(20):
        await a.step()
        if a.sent_batches:
            break
    for _ in range(20):  # b's first read after the restart may fail on its old connection
        await b.read(1)
        if b.applied_batches:
            break
    assert (a.sent_events, b.applied_events) == (2, 2)
    assert pb._inflow.as_dict() == pytest.approx(pa._inflow.as_dict())


async def test_in_flight_counts_reach_the_other_router_and_expire_with_their_writer(clients):
    """A's requests in flight show in B's loads (B's own plus A's); when A's requests
    finish B's count falls back; when A goes quiet past the TTL its counts are dropped."""
    from unicache.router.cluster.view import ClusterView
    from unicache.router.cluster.index import LocalityIndex

    now = [0.0]
    views = []
    for _ in range(2):
        view = ClusterView(CacheAwarePolicy(), LocalityIndex())
        for rid in ("r0", "r1"):
            view.upsert(rid, f"127.0.0.1:{1 + len(view.replicas)}")
        views.append(view)
    va, vb = views
    a = TermsExchange(clients[0], PREFIX, KEY, va.policy, va.replicas.__contains__, router_id="a", cluster=va,
                      clock=lambda: now[0])
    b = TermsExchange(clients[1], PREFIX, KEY, vb.policy, vb.replicas.__contains__, router_id="b", cluster=vb,
                      clock=lambda: now[0])
    await b.step()
    for _ in range(3):
        va.started("r0")
    vb.started("r0")
    await a.step()
    await b.step()
    assert {ld.replica_id: ld.in_flight for ld in vb.loads()} == {"r0": 4, "r1": 0}
    assert vb.total_in_flight() == 1  # its own admission bound counts its own requests
    await a.step()  # nothing changed, keepalive not due: no batch
    assert a.sent_batches == 1
    va.finished("r0")
    await a.step()
    await b.step()
    assert [ld.in_flight for ld in vb.loads()] == [3, 0] and a.sent_batches == 2
    now[0] += 0.6  # the keepalive is due: the same counts go out again
    await a.step()
    await b.step()
    assert a.sent_batches == 3 and [ld.in_flight for ld in vb.loads()] == [3, 0]
    now[0] += 2.5  # A heard from last 2.5 s ago, TTL 2 s
    await b.step()
    assert [ld.in_flight for ld in vb.loads()] == [1, 0]


async def test_queued_sums_reach_the_other_router_share_and_expire_with_their_writer(clients):
    """A's requests waiting for their first token enter B's queue share beside B's own;
    A's first tokens take them out; a writer gone quiet past the TTL drops out."""
    now = [0.0]
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    a = TermsExchange(clients[0], PREFIX, KEY, pa, KNOWN, router_id="a", clock=lambda: now[0])
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b", clock=lambda: now[0])
    await b.step()
    routed(pa, "r0", [1, 2, 3, 4], matched=3)  # 16 of 64 tokens uncached
    routed(pa, "r1", [5, 6])  # 32 of 32
    routed(pb, "r0", [7, 8, 9, 10])  # B's own: 64 of 64
    await a.step()
    await b.step()
    assert pa.queued_tokens() == {"r0": (16, 64), "r1": (32, 32)}
    assert pb._queues.share == {"r0": (16 + 64) / (64 + 64), "r1": 1.0}
    await a.step()  # nothing changed, no keepalive due: no batch
    assert a.sent_batches == 1
    hs = hash_id_blocks([1, 2, 3, 4])
    pa.on_first_token(RoutingRequest("q1", RequestClass(task=Task.OTHER), hs, 64, 16), "r0")
    await a.step()
    await b.step()
    assert a.sent_batches == 2 and pb._queues.share == {"r0": 1.0, "r1": 1.0}
    now[0] += 2.5  # A heard from last 2.5 s ago, TTL 2 s: only B's own request counts
    await b.step()
    assert pb._queues.share == {"r0": 1.0} and pb._queues.peer == {}


async def test_a_batch_older_than_the_max_age_is_refused_so_old_writers_can_be_forgotten(clients):
    pb = CacheAwarePolicy()
    now_ms = [10_000_000]
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b", max_age_s=60.0, wall_ms=lambda: now_ms[0])
    await b.read(1)
    old = TermsExchange(clients[0], PREFIX, KEY, CacheAwarePolicy(), KNOWN, router_id="w",
                        wall_ms=lambda: now_ms[0] - 61_000)
    ahead = TermsExchange(clients[0], PREFIX, KEY, CacheAwarePolicy(), KNOWN, router_id="v",
                          wall_ms=lambda: now_ms[0] + 61_000)
    fresh = TermsExchange(clients[0], PREFIX, KEY, CacheAwarePolicy(), KNOWN, router_id="u",
                          wall_ms=lambda: now_ms[0] - 59_000)
    for w in (old, ahead, fresh):
        await clients[0].xadd(w.stream, {"b": w.encode([RoutedEvent("r0", 1)])})
    await b.read(1)
    assert (b.rejected, b.applied_batches, pb._inflow.as_dict()) == (2, 1, {"r0": 1.0})


def _batches(raws: list[bytes]) -> list[router_pb2.RoutedBatch]:
    signer = StateSigner(KEY)
    return [router_pb2.RoutedBatch.FromString(signer.open("routed", raw)) for raw in raws]


async def _stream_batches(client, stream: str) -> list[router_pb2.RoutedBatch]:
    return _batches([fields[b"b"] for _, fields in await client.xrange(stream)])


async def test_queued_sums_travel_as_changes_between_complete_batches(clients):
    """After a complete batch, a batch carries only the replicas whose sums changed (a
    first token's replica with 0: gone); the reader's view stays the writer's exactly;
    the keepalive sends everything again."""
    now = [0.0]
    known = {"r0", "r1", "r2"}.__contains__
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    a = TermsExchange(clients[0], PREFIX, KEY, pa, known, router_id="a", clock=lambda: now[0])
    b = TermsExchange(clients[1], PREFIX, KEY, pb, known, router_id="b", clock=lambda: now[0])
    await b.step()
    routed(pa, "r0", [1, 2, 3, 4], matched=3)  # (16, 64)
    routed(pa, "r1", [5, 6])  # (32, 32)
    routed(pa, "r2", [7])  # (16, 16)
    await a.step()
    await b.step()
    assert b._peer_queued["a"][1] == pa.queued_tokens() == {"r0": (16, 64), "r1": (32, 32), "r2": (16, 16)}
    routed(pa, "r1", [8, 9, 10])  # r1: (80, 80)
    pa.on_first_token(RoutingRequest("q7", RequestClass(task=Task.OTHER), hash_id_blocks([7]), 16, 16), "r2")
    now[0] += 0.1
    await a.step()
    await b.step()
    assert b._peer_queued["a"][1] == pa.queued_tokens() == {"r0": (16, 64), "r1": (80, 80)}
    now[0] += 0.5  # the keepalive: complete again, though nothing changed
    await a.step()
    await b.step()
    full, delta, keepalive = await _stream_batches(clients[0], a.stream)
    assert (full.delta, delta.delta, keepalive.delta) == (False, True, False)
    assert dict(full.queued_prompt_tokens) == {"r0": 64, "r1": 32, "r2": 16}
    assert dict(delta.queued_prompt_tokens) == {"r1": 80, "r2": 0}
    assert dict(delta.queued_uncached_tokens) == {"r1": 80, "r2": 0}
    assert dict(keepalive.queued_prompt_tokens) == {"r0": 64, "r1": 80}
    assert b._peer_queued["a"][1] == {"r0": (16, 64), "r1": (80, 80)}
    assert pb._queues.share == {"r0": 16 / 64, "r1": 1.0}


async def test_a_reader_without_the_previous_batch_waits_for_a_complete_one(clients):
    """A reader that starts after the writer's complete batch applies the deltas' events
    but not their changes (it has no view to change) until the next complete batch; a
    failed send makes the writer's next batch complete."""
    now = [0.0]
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    a = TermsExchange(clients[0], PREFIX, KEY, pa, KNOWN, router_id="a", clock=lambda: now[0])
    routed(pa, "r0", [1, 2])
    await a.step()  # complete, before b reads
    b = TermsExchange(clients[1], PREFIX, KEY, pb, KNOWN, router_id="b", clock=lambda: now[0])
    await b.step()  # reads from the stream's end
    routed(pa, "r1", [3])
    now[0] += 0.1
    await a.step()  # a delta: r1 only
    await b.step()
    assert b.applied_events == 1 and "a" not in b._peer_queued and pb._inflow.get("r1") == 16.0
    real_xadd = a.redis.xadd

    async def failing(*args, **kwargs):
        raise ConnectionError("down")

    a.redis.xadd = failing
    routed(pa, "r0", [4])
    now[0] += 0.1
    await a.step()
    assert a.errors == 1
    a.redis.xadd = real_xadd
    now[0] += 0.1
    await a.step()  # complete again after the failure, keepalive not due
    await b.step()
    batches = await _stream_batches(clients[0], a.stream)
    assert [m.delta for m in batches] == [False, True, False]
    assert b._peer_queued["a"][1] == pa.queued_tokens() == {"r0": (48, 48), "r1": (16, 16)}


def test_the_policy_hands_over_the_queued_sums_that_moved_since_it_last_did():
    p = CacheAwarePolicy()
    routed(p, "r2", [9])  # before sharing terms: nothing is kept for an exchange
    p.share_terms()
    assert p.take_queued_changes() == {}
    routed(p, "r0", [1, 2, 3, 4], matched=3)  # (16, 64)
    routed(p, "r1", [5, 6])  # (32, 32)
    assert p.take_queued_changes() == {"r0": (16, 64), "r1": (32, 32)}
    assert p.take_queued_changes() == {}
    p.on_first_token(RoutingRequest("q5", RequestClass(task=Task.OTHER), hash_id_blocks([5, 6]), 32, 16), "r1")
    routed(p, "r0", [7])  # r0: (32, 80)
    assert p.take_queued_changes() == {"r0": (32, 80), "r1": (0, 0)}
    assert p.queued_tokens() == {"r0": (32, 80), "r2": (16, 16)}
