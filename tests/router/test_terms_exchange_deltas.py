"""The terms exchange's per-replica figures as changes: whatever a writer routes, whichever
of its sends fail and whichever batches a reader misses, the reader's view of the writer
is exact after every complete batch and after every delta that follows one it applied, and
otherwise unchanged by a delta (stale, never corrupted).

The stream is a list (a fake Redis whose XADD can fail): ``publish`` and ``decode`` run as
in the router, without the network.
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.contract.state_auth import StateSigner, parse_cluster_key
from unicache.router.cluster.terms_exchange import TermsExchange
from unicache.router.routing.base import RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
from unicache.testing.signed_state import CLUSTER_KEY
from unicache.v1 import router_pb2

KEY = parse_cluster_key(CLUSTER_KEY)
REPLICAS = ("r0", "r1", "r2", "r3")


class ListRedis:
    """XADD appends to a list, or fails while ``down``."""

    def __init__(self):
        self.entries: list[bytes] = []
        self.down = False

    async def xadd(self, stream, fields, maxlen=None, approximate=True):  # noqa: ARG002
        if self.down:
            raise ConnectionError("down")
        self.entries.append(fields["b"])


class Flights:
    """The cluster view's side the exchange reads: this router's requests in flight."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def own_in_flight(self) -> dict[str, int]:
        return {r: n for r, n in self.counts.items() if n}


ACTIONS = st.one_of(
    st.tuples(st.just("route"), st.integers(0, 3), st.integers(1, 6)),
    st.tuples(st.just("first"), st.integers(0, 5)),
    st.tuples(st.just("flight"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.sampled_from([0.05, 0.2, 0.6])),
)
# each action, then a publish: (its send fails, the reader misses the batch)
OPS = st.lists(st.tuples(ACTIONS, st.booleans(), st.booleans()), min_size=1, max_size=40)


@given(OPS)
@settings(max_examples=150, deadline=None)
def test_the_reader_view_is_exact_or_unchanged_after_every_batch(ops):
    asyncio.run(_run(ops))


async def _run(ops) -> None:
    now = [0.0]
    redis, flights = ListRedis(), Flights()
    policy = CacheAwarePolicy()
    known = set(REPLICAS).__contains__
    writer = TermsExchange(redis, "p", KEY, policy, known, router_id="w", cluster=flights, clock=lambda: now[0])
    reader = TermsExchange(None, "p", KEY, CacheAwarePolicy(), known, router_id="r", cluster=flights,
                           clock=lambda: now[0])
    queued: list[RoutingRequest] = []
    synced = False  # the reader applied every batch since the writer's last complete one
    n = 0
    for op, fails, missed in ops:
        if op[0] == "route":
            n += 1
            hs = hash_id_blocks([n * 1000 + i for i in range(op[2])])
            req = RoutingRequest(f"q{n}", RequestClass(task=Task.OTHER), hs, 16 * len(hs), 16)
            policy.on_request_routed(req, RouteDecision(REPLICAS[op[1]], "load", 0))
            queued.append(req)
        elif op[0] == "first" and queued:
            req = queued.pop(op[1] % len(queued))
            policy.on_first_token(req, next(r for r in REPLICAS if _routed_to(policy, req, r)))
        elif op[0] == "flight":
            flights.counts[REPLICAS[op[1]]] = op[2]
        elif op[0] == "tick":
            now[0] += op[1]
        before_q = _view(reader._peer_queued)
        before_f = _view(reader._peer_in_flight)
        sent_before = len(redis.entries)
        redis.down = fails
        await writer.publish()
        redis.down = False
        if len(redis.entries) == sent_before:
            continue  # nothing sent (failed, or nothing to say)
        raw = redis.entries[-1]
        complete = not router_pb2.RoutedBatch.FromString(StateSigner(KEY).open("routed", raw)).delta
        if missed:
            synced = False
            continue
        reader.decode(raw)
        synced = complete or synced
        if synced:
            assert _view(reader._peer_queued) == policy.queued_tokens()
            assert _view(reader._peer_in_flight) == flights.own_in_flight()
        else:
            assert _view(reader._peer_queued) == before_q
            assert _view(reader._peer_in_flight) == before_f


def _routed_to(policy: CacheAwarePolicy, req: RoutingRequest, rid: str) -> bool:
    q = policy._queues.requests.get(req.request_id)
    return q is not None and q[0] == rid


def _view(latest: dict) -> dict | None:
    got = latest.get("w")
    return dict(got[1]) if got is not None else None
