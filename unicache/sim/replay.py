"""Event-driven replay of a prepared trace through simulated replicas.

Requests arrive by timestamp and overlap in time. Each replica admits requests FIFO
(``unicache.sim.replica``), prefills them in batches on ``lanes`` workers for the time
the ``TimingModel`` gives, then decodes for ``output_length`` tokens. Prompt blocks join
the prefix cache when prefill ends, decode blocks when the request finishes; then the
request's blocks are released to the eviction policy with its class.

With a host tier (``host_capacity_blocks`` per replica) a GPU victim is demoted instead of
dropped and a match into host blocks promotes them; the promotion's copy time
(``TimingModel.promote_s``) is added to that request's TTFT and delays its decode.

With several replicas a routing policy (``unicache.router.routing``) picks one per request from
load snapshots and a ``LocalityIndex`` fed by the replicas' own store events: the same
policy objects the live router runs. With ``index_flush_s`` > 0 those events reach the
index as the live publisher sends them, at the replica's next flush (replica i of n
flushes at times (k + i/n) x ``index_flush_s``), so the index lags the caches as a live
router's does; with 0 it never lags.

Invariants:
    * Events at the same time run in the order pushed; events due no later than the next
      arrival run before it (a finish frees blocks before a new request is admitted).
    * Every request is admitted exactly once or rejected (it needs more blocks than the
      replica has), and every admitted request finishes.
    * The opt oracle's clock is the index of the request being admitted.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from unicache.contract.kv_events import BlockRemoved, BlockStored
from unicache.contract.kv_tier import Tier
from unicache.replica.eviction.opt import FutureAccesses
from unicache.replica.eviction.registry import make_host_policy, make_policy
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.store import KVStore, OutOfBlocks
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.router.routing.cost_model import CostModel
from unicache.router.routing.registry import make_routing_policy
from unicache.sim.metrics import ReplayCounters, result_record
from unicache.sim.prepare import PreparedTrace, SimRequest
from unicache.sim.replica import SimReplica
from unicache.sim.timing import TimingModel

_PREFILL_DONE = 0
_FINISH = 1
_PROGRESS_STEP = 256


@dataclass(slots=True)
class ReplayConfig:
    """One replay run.

    Attributes:
        policy: eviction policy name (``unicache.replica.eviction.registry``).
        capacity_blocks: KV blocks per replica.
        replicas: number of replicas (1: no router).
        router: routing policy name, required when ``replicas > 1`` and not pooled.
        pooled: one replica holding ``replicas * capacity_blocks`` blocks and
            ``replicas * lanes`` prefill workers (the shared-cache upper bound).
        lanes: concurrent prefill batches per replica (default 4; with the default
            timing one lane cannot keep up with the Mooncake trace's arrival rate).
        max_batch_requests: requests per prefill batch (default 8).
        max_batch_tokens: a batch stops growing once its uncached tokens reach this
            (default 16384; the first request always fits).
        timing: the prefill/decode time model.
        policy_kwargs: extra constructor arguments of the eviction policy.
        router_kwargs: keywords of the routing policy, as ``make_routing_policy`` takes them
            (``cache_aware``: fields of its ``CacheAwareConfig``; ablations).
        router_factory: builds the routing policy from ``router_kwargs`` instead of the
            registry (a study's variant that production does not register; ``router``
            still names it in the results).
        label: the name reported as ``policy`` (default: ``policy``), e.g. to tell
            ablation variants of one policy apart.
        rate_scale: arrival times are divided by this (default 1.0: as recorded; 2.0:
            the same requests arrive twice as fast). Session gaps shrink with it; the
            classes stay those ``prepare`` computed from the recorded times.
        host_capacity_blocks: host-tier blocks per replica (0: no host tier).
        host_policy: the host tier's eviction policy (registry name, built by
            ``make_host_policy``; default unicache).
        index_flush_s: the replicas' event publishing period (0: the index sees every
            store event at once; the live publisher's is ``EVENT_FLUSH_INTERVAL_S``,
            0.05 s). Loads are never stale: only the index lags.
        cost_model: a calibration (``unicache.router.routing.cost_model``) the routing
            policy prices decisions with, its backends assigned to the replicas in order
            (``CostModel.assigned``); None: the policy's token units.
    """

    policy: str
    capacity_blocks: int
    replicas: int = 1
    router: str | None = None
    pooled: bool = False
    lanes: int = 4
    max_batch_requests: int = 8
    max_batch_tokens: int = 16384
    timing: TimingModel = field(default_factory=TimingModel)
    policy_kwargs: dict = field(default_factory=dict)
    router_kwargs: dict = field(default_factory=dict)
    router_factory: Callable[..., RoutingPolicy] | None = None
    label: str | None = None
    rate_scale: float = 1.0
    host_capacity_blocks: int = 0
    host_policy: str = "unicache"
    index_flush_s: float = 0.0
    cost_model: CostModel | None = None


class Replay:
    """Runs one ``ReplayConfig`` over a ``PreparedTrace``; ``run()`` returns the result record.

    Args:
        trace: hashed, classified requests.
        config: what to run.
        future: the opt oracle (required for ``opt``; shared across runs, its clock is
            reset here).
        progress: draw a tqdm bar on stderr.
    """

    def __init__(
        self,
        trace: PreparedTrace,
        config: ReplayConfig,
        future: FutureAccesses | None = None,
        progress: bool = False,
    ):
        if config.capacity_blocks <= 0:
            raise ValueError("capacity must be at least one block")
        if config.replicas <= 0:
            raise ValueError("replicas must be positive")
        if config.lanes <= 0 or config.max_batch_requests <= 0:
            raise ValueError("lanes and max_batch_requests must be positive")
        if not config.rate_scale > 0:
            raise ValueError("rate_scale must be positive")
        if config.host_capacity_blocks < 0:
            raise ValueError("host capacity must not be negative")
        if not config.index_flush_s >= 0:
            raise ValueError("index_flush_s must not be negative")
        self.trace = trace
        self.config = config
        self.progress = progress
        self.block_size = trace.block_size
        self.timing = config.timing
        uses_opt = config.policy == "opt" or (config.host_capacity_blocks > 0 and config.host_policy == "opt")
        self.future = future if uses_opt else None
        if uses_opt and future is None:
            raise ValueError("the opt policy needs a FutureAccesses oracle")
        if self.future is not None:
            self.future.clock = -1
        n_stores = 1 if (config.pooled or config.replicas == 1) else config.replicas
        scale = config.replicas if config.pooled else 1
        self.replicas = [
            SimReplica(
                replica_id=f"r{i}",
                # NOTE: one store has no subscriber; its events would only be dropped.
                store=KVStore(config.capacity_blocks * scale, self.block_size, self._make_policy(),
                              collect_events=n_stores > 1, host=self._make_host(scale)),
                lanes=config.lanes * scale,
            )
            for i in range(n_stores)
        ]
        self._by_id = {r.replica_id: r for r in self.replicas}
        flush = config.index_flush_s if n_stores > 1 else 0.0
        self._flush_s = flush
        for i, rep in enumerate(self.replicas):
            rep.flush_phase_s = flush * i / n_stores
        self._now = 0.0  # the time of the arrival being routed
        self.router = None
        self.index: LocalityIndex | None = None
        self._routed: dict[str, RoutingRequest] = {}
        if n_stores > 1:
            if not config.router:
                raise ValueError("several replicas need a router")
            make = config.router_factory or (lambda **kw: make_routing_policy(config.router, **kw))
            self.router = make(**config.router_kwargs)
            self.router.update_replicas([r.replica_id for r in self.replicas])
            if config.cost_model is not None and hasattr(self.router, "set_cost_model"):
                self.router.set_cost_model(config.cost_model.assigned([r.replica_id for r in self.replicas]))
            self.index = LocalityIndex()
        self.counters = ReplayCounters()
        scale = config.rate_scale
        self._arrival = [r.arrival_s / scale for r in trace.requests] if scale != 1.0 else [r.arrival_s for r in trace.requests]
        self._heap: list = []
        self._seq = itertools.count()
        self._promote_s: dict[int, float] = {}  # request index -> its promotion's copy time

    def _make_policy(self):
        kwargs = dict(self.config.policy_kwargs)
        if self.config.policy == "opt":
            kwargs["future"] = self.future
        return make_policy(self.config.policy, **kwargs)

    def _make_host(self, scale: int) -> HostTier | None:
        cfg = self.config
        if not cfg.host_capacity_blocks:
            return None
        kwargs = {"future": self.future} if cfg.host_policy == "opt" else {}
        return HostTier(cfg.host_capacity_blocks * scale, make_host_policy(cfg.host_policy, **kwargs))

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        reqs = self.trace.requests
        n = len(reqs)
        heap = self._heap
        heappop = heapq.heappop
        bar = tqdm(total=n, disable=not self.progress, file=sys.stderr, unit="req", mininterval=0.5,
                   desc=f"{self.config.label or self.config.policy}@{self.config.capacity_blocks}", leave=False)
        start, cpu_start = time.perf_counter(), time.process_time()
        i = 0
        inf = float("inf")
        arrival = self._arrival
        while True:
            t_arrival = arrival[i] if i < n else inf
            if heap and heap[0][0] <= t_arrival:
                t, _, kind, rep, payload = heappop(heap)
                if kind == _FINISH:
                    self._finish(rep, payload, t)
                else:
                    self._prefill_done(rep, payload, t)
            elif i < n:
                self._arrive(reqs[i], t_arrival)
                i += 1
                if i % _PROGRESS_STEP == 0:
                    bar.update(_PROGRESS_STEP)
            else:
                break
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        bar.update(n - bar.n)
        bar.close()
        return self._result(elapsed, cpu)

    def _result(self, elapsed: float, cpu: float) -> dict:
        cfg = self.config
        rec = result_record(
            self.counters,
            policy=cfg.label or cfg.policy,
            capacity_blocks=cfg.capacity_blocks,
            block_accesses=self.trace.block_accesses,
            evictions=sum(r.store.stats.evictions for r in self.replicas),
            demotions=sum(r.store.host.stats.demotions for r in self.replicas if r.store.host is not None),
            host_capacity_blocks=cfg.host_capacity_blocks,
            host_policy=cfg.host_policy if cfg.host_capacity_blocks else None,
            elapsed_s=elapsed,
            cpu_s=cpu,
            rate_scale=cfg.rate_scale,
        )
        if cfg.replicas > 1:
            computed = [r.computed_prefill_tokens for r in self.replicas]
            mean = sum(computed) / len(computed)
            rec.update(
                router=cfg.router if not cfg.pooled else "pooled",
                replicas=cfg.replicas,
                pooled=cfg.pooled,
                load_imbalance=max(computed) / mean if mean else 1.0,
                index_flush_s=self._flush_s,
            )
        return rec

    # --------------------------------------------------------------- events
    def _arrive(self, req: SimRequest, t: float) -> None:
        self._now = t
        rep = self.replicas[0] if self.router is None else self._route(req)
        rep.waiting.append(req)
        rep.queued_prefill_tokens += req.prompt_tokens
        rep.in_flight += 1
        if rep.busy_lanes < rep.lanes:
            self._schedule(rep, t)
        self._publish(rep, t)

    def _publish(self, rep: SimReplica, t: float) -> None:
        """With ``index_flush_s``, hand the store's events made at ``t`` to the replica's
        next flush (without, ``_snapshot`` takes them straight from the store)."""
        if not self._flush_s:
            return
        events = self._take_events(rep)
        if events:
            f, phase = self._flush_s, rep.flush_phase_s
            rep.unpublished.append((phase + f * (math.floor((t - phase) / f) + 1), events))

    def _schedule(self, rep: SimReplica, t: float) -> None:
        """Start prefill batches on idle lanes while the head of the queue fits."""
        waiting = rep.waiting
        max_reqs, max_tokens = self.config.max_batch_requests, self.config.max_batch_tokens
        while rep.busy_lanes < rep.lanes and waiting:
            batch: list[SimRequest] = []
            uncached = 0
            while waiting and len(batch) < max_reqs and uncached < max_tokens:
                admitted = self._admit_head(rep, t)
                if admitted is None:
                    break
                batch.append(admitted[0])
                uncached += admitted[1]
            if not batch:
                break
            rep.busy_lanes += 1
            done = t + self.timing.prefill_s(len(batch), uncached)
            heapq.heappush(self._heap, (done, next(self._seq), _PREFILL_DONE, rep, batch))

    def _admit_head(self, rep: SimReplica, t: float) -> tuple[SimRequest, int] | None:
        """Allocate the blocks of the head of ``rep``'s queue and count its hits; returns it
        and its uncached prompt tokens, or None when the queue is empty or the head must
        wait for a running request's blocks (a head that can never fit, with nothing
        running, is rejected and the next one tried)."""
        store, waiting, future, counters, bs = rep.store, rep.waiting, self.future, self.counters, self.block_size
        while waiting:
            req = waiting[0]
            if future is not None:
                future.clock = req.index
            try:
                alloc = store.allocate(req.rid, req.prompt_hashes[: req.reusable_blocks], req.num_tokens, req.cls, t,
                                       req.prompt_tokens)
            except OutOfBlocks:
                if rep.running:
                    return None
                waiting.popleft()
                rep.queued_prefill_tokens -= req.prompt_tokens
                self._reject(rep, req)
                continue
            waiting.popleft()
            if req.reusable_blocks < len(req.prompt_hashes):
                # NOTE: the blocks a hit may not cover are computed, then cached as usual.
                store.add_block_hashes(req.rid, req.prompt_hashes[req.reusable_blocks:])
            rep.running += 1
            hits = alloc.num_hit_blocks
            hit_tokens = min(hits * bs, req.input_length)
            host_hits = alloc.num_host_hit_blocks
            if host_hits:
                counters.host_hit_blocks += host_hits
                self._promote_s[req.index] = self.timing.promote_s(host_hits, bs)
            counters.hit_blocks += hits
            counters.hit_tokens += hit_tokens
            counters.input_tokens += req.input_length
            counters.count_task(req.task_key, hits, len(req.prompt_hashes))
            uncached = req.input_length - hit_tokens
            rep.computed_prefill_tokens += uncached
            return req, uncached
        return None

    def _prefill_done(self, rep: SimReplica, batch: list[SimRequest], t: float) -> None:
        rep.busy_lanes -= 1
        store = rep.store
        ttfts = self.counters.ttfts
        decode_s = self.timing.decode_s
        arrival = self._arrival
        promote = self._promote_s
        if self.router is not None:
            # the live router sees a request's first token when its prefill is done
            first_token, routed, rid = self.router.on_first_token, self._routed, rep.replica_id
            for req in batch:
                first_token(routed[req.rid], rid)
        for req in batch:
            rep.queued_prefill_tokens -= req.prompt_tokens
            # NOTE: a promotion's copy delays only its own request (copies run on the
            # copy engine, beside the lane's compute).
            delay = promote.pop(req.index, 0.0) if promote else 0.0
            ttfts.append(t + delay - arrival[req.index])
            store.cache_blocks(req.rid, t, len(req.prompt_hashes))
            heapq.heappush(self._heap, (t + delay + decode_s(req.output_length), next(self._seq), _FINISH, rep, req))
        self._schedule(rep, t)
        self._publish(rep, t)

    def _finish(self, rep: SimReplica, req: SimRequest, t: float) -> None:
        self._release(rep, req, t)
        self._schedule(rep, t)
        self._publish(rep, t)

    def _release(self, rep: SimReplica, req: SimRequest, t: float) -> None:
        """``req`` finished at ``t``: its output blocks join the cache, its blocks go back to
        the eviction policy, and the router hears of it."""
        store = rep.store
        if req.output_hashes:
            store.add_block_hashes(req.rid, req.output_hashes)
            store.cache_blocks(req.rid, t)
        store.free(req.rid, t)
        rep.running -= 1
        self._done(rep, req)

    def _reject(self, rep: SimReplica, req: SimRequest) -> None:
        c = self.counters
        c.rejected += 1
        c.input_tokens += req.input_length
        c.count_task(req.task_key, 0, len(req.prompt_hashes))
        self._done(rep, req)

    def _done(self, rep: SimReplica, req: SimRequest) -> None:
        rep.in_flight -= 1
        if self.router is not None:
            self.router.on_request_finished(self._routed.pop(req.rid), rep.replica_id)

    # -------------------------------------------------------------- routing
    def _route(self, req: SimRequest) -> SimReplica:
        assert self.router is not None
        loads = self._snapshot()
        rr = RoutingRequest(req.rid, req.cls, req.prompt_hashes, req.input_length, self.block_size)
        decision = self._decide(rr, loads)
        self.router.on_request_routed(rr, decision)
        self._routed[req.rid] = rr
        return self._by_id[decision.replica_id]

    def _snapshot(self) -> list[ReplicaLoad]:
        """Bring the index up to date with every store's events (with ``index_flush_s``:
        those flushed by now); every replica's load."""
        index = self.index
        assert index is not None
        loads = []
        now = self._now
        for rep in self.replicas:
            if not self._flush_s:
                _pump(index, rep.replica_id, self._take_events(rep))
            else:
                due = rep.unpublished
                events = []
                while due and due[0][0] <= now:
                    events.extend(due.popleft()[1])
                if events or not index.has_replica(rep.replica_id):
                    _pump(index, rep.replica_id, events)
            loads.append(
                ReplicaLoad(
                    replica_id=rep.replica_id,
                    running=rep.running,
                    waiting=len(rep.waiting),
                    queued_prefill_tokens=rep.queued_prefill_tokens,
                    free_blocks=rep.store.num_free_blocks,
                    capacity_blocks=rep.store.num_blocks,
                    in_flight=rep.in_flight,
                )
            )
        return loads

    def _take_events(self, rep: SimReplica) -> list:
        """The store's new events (a hook: the parity harness also publishes them)."""
        return rep.store.take_events()

    def _decide(self, request: RoutingRequest, loads: list[ReplicaLoad]) -> RouteDecision:
        """The routing policy's choice (a hook: the parity harness also asks the live router)."""
        assert self.index is not None and self.router is not None
        return self.router.choose(request, loads, self.index)


def _pump(index: LocalityIndex, replica_id: str, events: list) -> None:
    """Apply store events to the index in order, parents included, each tier's events to
    its side (a batch applies removes before stores, so a remove that follows a store of
    the same tier starts a new batch)."""
    stored: list = []
    parents: list = []
    removed: list = []
    host_stored: list = []
    host_removed: list = []

    def flush() -> None:
        index.apply_events_unchecked(replica_id, stored, removed, parents, host_stored=host_stored,
                                     host_removed=host_removed)
        for lst in (stored, parents, removed, host_stored, host_removed):
            lst.clear()

    for ev in events:
        kind = type(ev)
        if kind is BlockStored:
            if ev.tier is Tier.GPU:
                stored.append(ev.block_hash)
                parents.append(ev.parent_hash)
            else:
                host_stored.append(ev.block_hash)
        elif kind is BlockRemoved:
            if ev.tier is Tier.GPU:
                if stored:
                    flush()
                removed.append(ev.block_hash)
            else:
                if host_stored:
                    flush()
                host_removed.append(ev.block_hash)
        else:  # AllBlocksCleared: what came before it is superseded
            for lst in (stored, parents, removed, host_stored, host_removed):
                lst.clear()
            index.apply_events_unchecked(replica_id, (), (), cleared=True)
    if stored or removed or host_stored or host_removed or not index.has_replica(replica_id):
        flush()
