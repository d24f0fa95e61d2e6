"""Parity of routing decisions: the simulator's policy path against the live router's.

One trace slice is replayed by the simulator (``unicache.sim.replay.Replay``). At every
routing decision, before its own policy chooses, each simulated replica's new store
events and its load go out the way a real replica's do: a ``CachePublisher`` flushes them
as a ``KVEventBatch`` to Redis and publishes a ``Heartbeat``. A live ``RouterApp``
follows that Redis with its ``RedisSubscriber``; once its index equals every replica's
cache and its heartbeats carry the replica's current load (the index is *fresh*), the
router's own decision path (``RouterCore.choose``: loads from heartbeats, locality from
the Redis-fed index, the router's policy object) decides too. Both policies are then told
the simulator's decision (``on_request_routed``), every first token and every finish, so a disagreement does
not carry over into later steps; the record is the agreement per step.

Invariants:
    * The publishers never run their own loops' flushes in between (their intervals are
      hours): only the driver publishes, while the replay thread waits.
    * The replay runs in a worker thread; every Redis and router call runs on the event
      loop that owns them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from unicache.contract.redis_keys import RedisKeys
from unicache.replica.engines.api import EngineLoad
from unicache.replica.publishing.publisher import CachePublisher
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest
from unicache.sim.prepare import PreparedTrace
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.replica import SimReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import SIGNER
from unicache.testing.store_source import StoreCacheSource

_NEVER_S = 3600.0


class SimReplicaSource(StoreCacheSource):
    """A ``CacheSource`` over one simulated replica: its store's holdings, its load, and
    the events the driver hands over (the replay consumes the store's own queue)."""

    def __init__(self, rep: SimReplica):
        super().__init__(rep.store)
        self.rep = rep
        self.events: list = []

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def load(self) -> EngineLoad:
        rep = self.rep
        return EngineLoad(running=rep.running, waiting=len(rep.waiting), queued_prefill_tokens=rep.queued_prefill_tokens)


@dataclass(slots=True)
class Step:
    request_id: str
    sim: str
    live: str
    sim_reason: str
    live_reason: str


@dataclass(slots=True)
class ParityRecord:
    steps: list[Step] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    @property
    def agreement(self) -> float:
        return sum(s.sim == s.live for s in self.steps) / len(self.steps) if self.steps else 1.0


class _ParityReplay(Replay):
    def __init__(self, driver: "ParityDriver", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.driver = driver

    def _take_events(self, rep: SimReplica) -> list:
        events = rep.store.take_events()
        self.driver.sources[rep.replica_id].events.extend(events)
        return events

    def _decide(self, request: RoutingRequest, loads: list[ReplicaLoad]) -> RouteDecision:
        sim = super()._decide(request, loads)
        live = self.driver.live_decision(request)
        self.driver.record.steps.append(Step(request.request_id, sim.replica_id, live.replica_id, sim.reason, live.reason))
        self.driver.app.policy.on_request_routed(request, sim)
        return sim

    def _prefill_done(self, rep: SimReplica, batch: list, t: float) -> None:
        for req in batch:
            self.driver.app.policy.on_first_token(self._routed[req.rid], rep.replica_id)
        super()._prefill_done(rep, batch, t)

    def _done(self, rep: SimReplica, req) -> None:
        rr = self._routed.get(req.rid)
        super()._done(rep, req)
        if rr is not None:
            self.driver.app.policy.on_request_finished(rr, rep.replica_id)


class ParityDriver:
    """Runs the parity replay against a started ``RouterApp`` (``app``) that follows
    ``redis_url`` under ``prefix``; the app's policy must be a fresh instance of
    ``config.router`` built with ``config.router_kwargs``.

    Args:
        app: the live router (started, its replica set empty).
        redis_url / prefix: where the simulated replicas publish.
        trace / config: the replay (``config.replicas > 1``, ``config.router`` set).
        timeout_s: deadline of each wait for the router to catch up.
    """

    def __init__(self, app, redis_url: str, prefix: str, trace: PreparedTrace, config: ReplayConfig,
                 timeout_s: float = 30.0):
        self.app = app
        self.redis_url, self.prefix = redis_url, prefix
        self.replay = _ParityReplay(self, trace, config)
        self.sources = {r.replica_id: SimReplicaSource(r) for r in self.replay.replicas}
        self.publishers: dict[str, CachePublisher] = {}
        self.record = ParityRecord()
        self.timeout_s = timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> ParityRecord:
        self.loop = asyncio.get_running_loop()
        for rid, src in self.sources.items():
            pub = CachePublisher(src, rid, self.redis_url, self.address(rid), RedisKeys(self.prefix), signer=SIGNER,
                                 flush_interval_s=_NEVER_S, heartbeat_interval_s=_NEVER_S, summary_interval_s=_NEVER_S)
            await pub.start()
            self.publishers[rid] = pub
        try:
            await self._publish()
            self.record.result = await asyncio.to_thread(self.replay.run)
        finally:
            for pub in self.publishers.values():
                await pub.stop()
        return self.record

    @staticmethod
    def address(replica_id: str) -> str:
        """The address a simulated replica advertises (nothing listens there)."""
        return f"127.0.0.1:{replica_id}"

    async def fetch_summary(self, address: str, nonce: bytes, timeout_s: float) -> bytes:  # noqa: ARG002
        """The router's ``GetCacheSummary`` call, answered by the simulated replica's publisher
        (a real replica's servicer answers with the same ``signed_summary``)."""
        for rid, pub in self.publishers.items():
            if self.address(rid) == address:
                return await pub.signed_summary(nonce)
        raise ConnectionError(address)

    def live_decision(self, request: RoutingRequest) -> RouteDecision:
        """Called on the replay thread: publish, wait for the router, take its decision."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._live(request), self.loop)
        return fut.result(timeout=self.timeout_s + 10)

    async def _publish(self) -> None:
        t_before = time.time()
        for pub in self.publishers.values():
            if not await pub.flush() or not await pub.publish_heartbeat():
                raise RuntimeError(f"replica {pub.replica_id}: publishing to Redis failed")
        await eventually(lambda: self._fresh(t_before), "router index and heartbeats fresh", self.timeout_s, 0.005)

    def _fresh(self, t_before: float) -> bool:
        cluster, index = self.app.cluster, self.app.index
        for rid, src in self.sources.items():
            rec = cluster.replicas.get(rid)
            if rec is None or rec.heartbeat is None or index.needs_resync(rid) or not cluster.redis_connected:
                return False
            hb, rep = rec.heartbeat, src.rep
            if hb.timestamp < t_before or (hb.running, hb.waiting, hb.queued_prefill_tokens, hb.cache.free_blocks) != (
                    rep.running, len(rep.waiting), rep.queued_prefill_tokens, rep.store.num_free_blocks):
                return False
            if set(index.holdings(rid).blocks) != set(rep.store.cached_hashes()):
                return False
        return True

    async def _live(self, request: RoutingRequest) -> RouteDecision:
        await self._publish()
        return self.app.core.choose(request, set())


# Router tunables for parity runs: the router follows Redis within a few milliseconds.
PARITY_SUBSCRIBER = {"heartbeat_interval_s": 0.02, "block_ms": 10, "resync_retry_s": 0.02}


async def run_parity(redis_url: str, prefix: str, trace: PreparedTrace, config: ReplayConfig) -> ParityRecord:
    """Starts a live ``RouterApp`` (the config's routing policy, a fresh instance, priced
    with the config's ``cost_model`` when it has one, as the simulator prices) that
    follows ``redis_url``, runs the parity replay against it and stops it. The simulated
    replicas sign their state with the test cluster key and answer the router's
    ``GetCacheSummary`` through their publishers, as real replicas do."""
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config
    from unicache.router.routing.registry import make_routing_policy
    from unicache.testing.signed_state import CLUSTER_KEY

    drivers: list[ParityDriver] = []

    async def fetch_summary(address: str, nonce: bytes, timeout_s: float) -> bytes:
        return await drivers[0].fetch_summary(address, nonce, timeout_s)

    app = RouterApp(
        build_config(env={}, overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_url, "redis_prefix": prefix,
                                        "block_size": trace.block_size, "auth_enabled": False,
                                        "cluster_key": CLUSTER_KEY, "insecure_no_tls": True}),
        policy=make_routing_policy(config.router, **config.router_kwargs),
        subscriber_kwargs={**PARITY_SUBSCRIBER, "fetch_summary": fetch_summary},
    )
    if config.cost_model is not None:
        # the simulator's pricing (``Replay``: the calibration assigned to r0, r1, ...), not
        # the live router's own learning: only ``RouterCore.choose`` runs here
        app.policy.set_cost_model(config.cost_model.assigned([f"r{i}" for i in range(config.replicas)]))
    drivers.append(ParityDriver(app, redis_url, prefix, trace, config))
    await app.start()
    try:
        return await drivers[0].run()
    finally:
        await app.stop()
