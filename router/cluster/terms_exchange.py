"""Routing terms shared by every router of a cluster, through one Redis stream.

``cache_aware`` weighs each replica by terms it derives from the traffic it routed: the
churn inflow (uncached prompt tokens sent to each replica, decayed per routed request) and
the session footprint (the prompt blocks of live sessions' latest turns there). Several
router processes (``--workers N``) or pods each see only their share of the traffic, so
alone each would hold different terms and decide differently. The exchange makes them one:
each router's policy records what its decisions did (``SharesRouterState.take_routed``:
``RoutedEvent``s); every ``interval_s`` the exchange seals the new ones into a
``RoutedBatch`` and appends it to the stream ``P:routed``, and applies what the other
routers appended (``SharesRouterState.apply_routed``). Every router then holds the terms one
router routing all the traffic would hold, up to the exchange's lag (exact when each batch
is applied before the next decision: ``tests/router/test_terms_sharing.py``). Sessions' records
travel through the session store (``unicache.router.cluster.session_store``), which the exchange
always runs beside.

In-flight counts travel the same way: every batch carries its writer's requests in flight
per replica (``RoutedBatch.in_flight``), a router sends one at least every
``keepalive_s`` (or as soon as its counts change), and each router adds the latest counts
of every writer heard from within ``peer_ttl_s`` to its own (``ClusterView
.set_peer_in_flight``): so ``ReplicaLoad.in_flight``, which the policies weigh, is the
cluster's, not one router's share of it. A router that stops (or whose batches stop
arriving) drops out of the sum after ``peer_ttl_s``. ``cache_aware``'s queue share travels
alike: each batch carries its writer's uncached and whole prompt tokens of the requests it
routed that have not sent their first token, per replica (``SharesRouterState.queued_tokens``;
``RoutedBatch.queued_uncached_tokens`` / ``queued_prompt_tokens``), and each round hands
the policy the sums of every other live writer's latest (``set_peer_queued``), so every
router scales a replica's published queue by the share of all routers' waiting requests.

Those maps travel as deltas: a batch carries the replicas whose counts or sums changed
since the writer's previous batch (``RoutedBatch.delta``; 0 removes a replica), and a
complete batch goes out at least every ``keepalive_s`` and after any batch that may not
have arrived (a failed send). A reader applies a delta only on top of the writer's batch
just before it (seq - 1) that it applied; after a gap it keeps that writer's last view,
not refreshed, until the next complete batch. The writer learns the changed sums from
the policy (``SharesRouterState.take_queued_changes``), and a reader reshares only the replicas
whose totals moved, so a round costs what changed, not the fleet (except the complete
batches). At 1,024 replicas with every replica holding queued requests a complete batch
carries about 22 KB of sums, a delta about 22 bytes per replica its events touched
(``bench.terms_exchange_cost``).

Invariants:
    * A batch is sealed with the cluster's state key (kind "routed", ``unicache.contract.state_auth``)
      and names its writer and a per-writer ``seq`` from 1: a batch that fails its MAC or
      does not parse, that repeats or goes back on a writer's seq (a replay), that was
      written more than ``max_age_s`` ago or ahead (by its ``sent_ms``, so a writer's seq
      need only be remembered that long), or that holds more than ``max_batch_events``
      events is dropped whole and counted (``rejected``); the router's own batches are
      skipped.
    * A reader's view of a writer's in-flight counts and queued sums is the one that
      writer sent, at most ``keepalive_s`` (plus the stream's delay) late: complete
      batches set it, deltas change it only when they follow the batch it was built
      from.
    * Memory: at most ``max_pending`` unsent events (about 100 bytes each), and per other
      writer heard from within ``max_age_s`` its seq, in-flight counts and queued sums (and
      the seq those figures are exact for).
    * An event for a replica the router does not know (``is_known``), or with a share
      that is negative or not finite, is dropped and counted; the others of its batch
      are applied, in order, batches in stream order.
    * A Redis failure is counted (``errors``) and never raised: the unsent events wait for
      the next round (at most ``max_pending``, oldest dropped first) and the router goes on
      deciding on the terms it has.
    * The stream is trimmed to about ``ROUTED_STREAM_MAXLEN`` entries; a router reads from
      the stream's end as it starts (what came before is already decayed into the others'
      terms, and the replicas' state does not depend on it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable

from unicache.contract.redis_keys import ROUTED_STREAM_MAXLEN, RedisKeys
from unicache.contract.state_auth import StateAuthError, StateSigner
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.base import RoutedEvent, RoutingPolicy, SharesRouterState
from unicache.v1 import router_pb2

log = logging.getLogger(__name__)

KIND = "routed"


def _changes(new: dict, old: dict, gone):
    """The entries of ``new`` that differ from ``old``, and ``gone`` for keys only in ``old``."""
    out = {k: v for k, v in new.items() if old.get(k) != v}
    for k in old.keys() - new.keys():
        out[k] = gone
    return out


def _apply_changes(view: dict, changes, keep: Callable) -> None:
    """Apply ``changes`` ((key, value) pairs) to ``view`` in place: a value ``keep(key,
    value)`` accepts is set, any other removes the key (a 0 count or sum means gone; the
    inverse of ``_changes``)."""
    for k, v in changes:
        if keep(k, v):
            view[k] = v
        else:
            view.pop(k, None)


def new_router_id() -> str:
    """A name for this router process that no other router of the cluster shares."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class TermsExchange:
    """Publishes this router's routed events and applies the other routers' (see the
    module docstring).

    Args:
        redis: a ``redis.asyncio`` client of its own (``run`` blocks on it).
        prefix: the cluster's Redis key prefix.
        cluster_key: the cluster key (batches are sealed with its state key).
        policy: the routing policy whose terms are shared when it implements
            ``SharesRouterState`` (``share_terms`` is called); other policies share none,
            and only in-flight counts travel.
        is_known: whether a replica id is one the router follows (events for others are
            dropped).
        router_id: this router's name in its batches (default ``new_router_id()``).
        interval_s: how often a batch is sent and the stream read (default 0.05 s, the
            replicas' event flush interval).
        timeout_s: deadline of each Redis call beyond the read's own block (default 1 s).
        max_pending: unsent events kept while Redis fails (default 20,000: 0.4 s of
            traffic at 50,000 requests per second).
        max_batch_events: the most events a batch may hold (default 20,000).
        counter: a Prometheus counter labelled (outcome) to count batches in (the router's
            ``unicache_router_terms_exchange``; None: the attributes only).
        cluster: the router's cluster view, whose in-flight counts are shared (None: only
            the policy's terms are).
        keepalive_s: a complete batch (every in-flight count and queued sum, not only
            the changes) goes out at least this often (default 0.5 s).
        peer_ttl_s: another router's in-flight counts count this long after its latest
            batch (default 2 s).
        max_age_s: a batch written longer ago than this (or this far ahead: clock skew) is
            refused (default 60 s).
        clock: monotonic clock.
        wall_ms: unix-ms clock (batches' ``sent_ms``).
    """

    def __init__(self, redis, prefix: str, cluster_key: bytes, policy: RoutingPolicy, is_known: Callable[[str], bool],
                 router_id: str | None = None, interval_s: float = 0.05, timeout_s: float = 1.0,
                 max_pending: int = 20_000, max_batch_events: int = 20_000, counter=None,
                 cluster: ClusterView | None = None, keepalive_s: float = 0.5, peer_ttl_s: float = 2.0,
                 max_age_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)):
        if interval_s <= 0 or timeout_s <= 0 or max_pending <= 0 or max_batch_events <= 0:
            raise ValueError("interval_s, timeout_s, max_pending and max_batch_events must be positive")
        if not 0 < keepalive_s < peer_ttl_s < max_age_s:
            raise ValueError("need 0 < keepalive_s < peer_ttl_s < max_age_s")
        self.redis = redis
        self.stream = RedisKeys(prefix).routed_stream()
        self.signer = StateSigner(cluster_key)
        self.policy = policy
        self.shared: SharesRouterState | None = policy if isinstance(policy, SharesRouterState) else None
        if self.shared is not None:
            self.shared.share_terms()  # False for a policy without such terms: then only in-flight counts travel
        self.is_known = is_known
        self.router_id = router_id or new_router_id()
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_batch_events = max_batch_events
        self._pending: list[RoutedEvent] = []
        self._seq = 0
        self._last_id: str | None = None  # stream position read up to
        self._peer_seq: dict[str, tuple[int, float]] = {}  # writer -> (last seq, heard at)
        self._view_seq: dict[str, int] = {}  # writer -> seq of the batch its figures here are exact for
        self.max_age_s = max_age_s
        self.wall_ms = wall_ms
        self.sent_batches = self.sent_events = self.applied_batches = self.applied_events = 0
        self.rejected = self.dropped_events = self.errors = 0
        self._counter = counter
        self.cluster = cluster
        self.keepalive_s = keepalive_s
        self.peer_ttl_s = peer_ttl_s
        self.clock = clock
        self._sent_in_flight: dict[str, int] | None = None  # the counts of the last batch sent
        self._full_at = -float("inf")  # when the last complete batch was sent
        self._need_full = True  # the next batch must be complete (none sent yet, or a send failed)
        self._peer_in_flight: dict[str, tuple[float, dict[str, int]]] = {}  # writer -> (heard at, counts)
        self._sent_queued: dict[str, tuple[int, int]] = {}  # the queued sums of the last batch sent
        # writer -> (heard at, replica -> (uncached, whole) queued prompt tokens)
        self._peer_queued: dict[str, tuple[float, dict[str, tuple[int, int]]]] = {}

    def _count(self, outcome: str) -> None:
        if self._counter is not None:
            self._counter.labels(outcome).inc()

    # -- one round ------------------------------------------------------------------

    def encode(self, events: list[RoutedEvent], in_flight: dict[str, int] | None = None,
               queued: dict[str, tuple[int, int]] | None = None, delta: bool = False) -> bytes:
        """The next sealed batch of ``events``, this router's ``in_flight`` counts and its
        ``queued`` (uncached, whole) prompt tokens per replica (advances this writer's seq);
        ``delta``: the maps given are the changes since the last batch sent (0: gone)."""
        self._seq += 1
        queued = queued or {}
        msg = router_pb2.RoutedBatch(router_id=self.router_id, seq=self._seq, in_flight=in_flight or {}, delta=delta,
                                     sent_ms=self.wall_ms(),
                                     queued_uncached_tokens={rid: q[0] for rid, q in queued.items()},
                                     queued_prompt_tokens={rid: q[1] for rid, q in queued.items()})
        for ev in events:
            msg.events.add(replica_id=ev.replica_id, new_tokens=ev.new_tokens, session_blocks=ev.session_blocks,
                           prev_replica_id=ev.prev_replica_id, prev_share=ev.prev_share)
        return self.signer.seal(KIND, msg.SerializeToString())

    def decode(self, raw: bytes) -> list[RoutedEvent] | None:
        """The events of another router's batch to apply; None when there is nothing to
        apply: this router's own batch, or one rejected (counted)."""
        try:
            msg = router_pb2.RoutedBatch.FromString(self.signer.open(KIND, raw))
        except (StateAuthError, ValueError):
            self.rejected += 1
            self._count("rejected")
            return None
        if msg.router_id == self.router_id:
            return None
        last = self._peer_seq.get(msg.router_id)
        if (not msg.router_id or (last is not None and msg.seq <= last[0]) or len(msg.events) > self.max_batch_events
                or abs(self.wall_ms() - msg.sent_ms) > 1000 * self.max_age_s):
            self.rejected += 1
            self._count("rejected")
            return None
        now = self.clock()
        self._peer_seq[msg.router_id] = (msg.seq, now)
        if len(self._peer_seq) > 64:
            # NOTE: a writer unheard for max_age_s can only send batches refused as too old
            # or newer seqs, so its last seq is no longer needed.
            for w in [w for w, (_, heard) in self._peer_seq.items() if now - heard > self.max_age_s]:
                del self._peer_seq[w]
                self._view_seq.pop(w, None)
        self._take_views(msg, now)
        out = []
        for ev in msg.events:
            share = ev.prev_share
            if not self.is_known(ev.replica_id) or not (math.isfinite(share) and share >= 0.0):
                self.dropped_events += 1
                continue
            out.append(RoutedEvent(ev.replica_id, ev.new_tokens, ev.session_blocks, ev.prev_replica_id, share))
        return out

    def _take_views(self, msg: router_pb2.RoutedBatch, now: float) -> None:
        """Set (complete batch) or change (a delta right after the writer's batch whose
        figures this reader holds) the writer's in-flight counts and queued sums; any other
        delta leaves them as they were, not refreshed, until the next complete batch."""
        writer, known = msg.router_id, self.is_known
        # NOTE: a delta builds on the writer's previous batch: only if these figures came
        # from it (a batch seen but not applied after a gap does not count)
        follows = self._view_seq.get(writer) == msg.seq - 1
        self._view_seq.pop(writer, None)  # set again below only when the figures stay exact
        sharing_counts = self.cluster is not None
        if not msg.delta:  # a complete batch: the changes from nothing
            sums: dict[str, tuple[int, int]] = {}
            flights: dict[str, int] | None = {} if sharing_counts else None
        else:
            queued = self._peer_queued.get(writer)
            counts = self._peer_in_flight.get(writer) if sharing_counts else None
            if not follows or queued is None or (sharing_counts and counts is None):
                return
            sums, flights = queued[1], (counts[1] if counts is not None else None)
        unc = msg.queued_uncached_tokens
        changed = ((rid, (min(unc.get(rid, 0), whole), whole)) for rid, whole in msg.queued_prompt_tokens.items())
        _apply_changes(sums, changed, lambda rid, v: v[1] and known(rid))
        self._peer_queued[writer] = (now, sums)
        if flights is not None:
            _apply_changes(flights, msg.in_flight.items(), lambda rid, n: n and known(rid))
            self._peer_in_flight[writer] = (now, flights)
        self._view_seq[writer] = msg.seq

    async def publish(self) -> None:
        """Append this router's new events (and in-flight counts and queued sums, as
        changes or complete) to the stream as one batch (kept on failure); nothing when
        there are no events, the counts and sums are as last sent and no complete batch is
        due."""
        pending = self._pending
        shared, sent = self.shared, self._sent_queued
        if shared is not None:
            pending.extend(shared.take_routed())
        if len(pending) > self.max_pending:
            del pending[: len(pending) - self.max_pending]
        in_flight = self.cluster.own_in_flight() if self.cluster is not None else None
        now = self.clock()
        full = self._need_full or now - self._full_at >= self.keepalive_s
        if shared is None:
            queued = {}
        elif full:
            queued = shared.queued_tokens()
            shared.take_queued_changes()  # a complete batch carries them all
        else:  # NOTE: the replicas whose sums moved since the last round, not every replica
            queued = {rid: v for rid, v in shared.take_queued_changes().items() if sent.get(rid, (0, 0)) != v}
        if not pending:
            if self.cluster is None and not queued and not sent:
                return  # nothing to send or keep alive
            if not full and not queued and in_flight == self._sent_in_flight:
                return
        events = pending[: self.max_batch_events]
        flights = in_flight if full or in_flight is None else _changes(in_flight, self._sent_in_flight or {}, 0)
        raw = self.encode(events, flights, queued, delta=not full)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.redis.xadd(self.stream, {"b": raw}, maxlen=ROUTED_STREAM_MAXLEN, approximate=True)
        except Exception as exc:  # noqa: BLE001 - any failure: keep the events, go on
            self.errors += 1
            self._count("error")
            log.debug("routed batch not sent: %s", type(exc).__name__)
            self._need_full = True  # it may have been written all the same: the readers' next base is uncertain
            return
        del pending[: len(events)]
        self._sent_in_flight = in_flight
        if full:
            self._sent_queued = queued
            self._full_at, self._need_full = now, False
        else:
            _apply_changes(sent, queued.items(), lambda rid, v: v[1])
        self.sent_batches += 1
        self.sent_events += len(events)
        self._count("sent")

    async def read(self, block_ms: int) -> None:
        """Apply the other routers' batches appended since the last read (waiting up to
        ``block_ms`` for one)."""
        try:
            async with asyncio.timeout(self.timeout_s + block_ms / 1000.0):
                if self._last_id is None:
                    last = await self.redis.xrevrange(self.stream, count=1)
                    self._last_id = last[0][0].decode() if last else "0-0"
                reply = await self.redis.xread({self.stream: self._last_id}, block=block_ms, count=1000)
        except Exception as exc:  # noqa: BLE001
            self.errors += 1
            self._count("error")
            log.debug("routed stream not read: %s", type(exc).__name__)
            return
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                events = self.decode(fields.get(b"b", b""))
                if events is None:
                    continue
                if self.shared is not None:
                    self.shared.apply_routed(events)
                self.applied_batches += 1
                self.applied_events += len(events)
                self._count("applied")

    def _live(self, latest: dict[str, tuple[float, dict]]) -> list[dict]:
        """The latest snapshots of the other routers in ``latest`` (writer -> (heard at,
        snapshot)) heard from within ``peer_ttl_s``; older writers are forgotten."""
        horizon = self.clock() - self.peer_ttl_s
        for writer in [w for w, (heard, _) in latest.items() if heard < horizon]:
            del latest[writer]
        return [snapshot for _, snapshot in latest.values()]

    def peer_in_flight(self) -> dict[str, int]:
        """The sum of the in-flight counts of every other live router (``_live``)."""
        total: dict[str, int] = {}
        for counts in self._live(self._peer_in_flight):
            for rid, n in counts.items():
                total[rid] = total.get(rid, 0) + n
        return total

    def peer_queued(self) -> dict[str, tuple[int, int]]:
        """The sums of the queued (uncached, whole) prompt tokens of every other live
        router (``_live``)."""
        live = self._live(self._peer_queued)
        if len(live) == 1:  # one other router (two in all): its sums are the total
            return dict(live[0])
        total: dict[str, tuple[int, int]] = {}
        for sums in live:
            for rid, (unc, whole) in sums.items():
                t = total.get(rid, (0, 0))
                total[rid] = (t[0] + unc, t[1] + whole)
        return total

    async def step(self) -> None:
        """One round: send what this router routed, apply what the others sent, and
        hand the cluster view the other routers' in-flight counts and the policy their
        queued sums."""
        await self.publish()
        await self.read(max(1, int(self.interval_s * 1000)))
        if self.cluster is not None:
            self.cluster.set_peer_in_flight(self.peer_in_flight())
        if self.shared is not None:
            self.shared.set_peer_queued(self.peer_queued())

    async def run(self) -> None:
        """Rounds until cancelled (a failing round waits an interval before the next)."""
        while True:
            errors = self.errors
            await self.step()
            if self.errors != errors:
                await asyncio.sleep(self.interval_s)
