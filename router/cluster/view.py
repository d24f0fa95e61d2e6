"""The router's view of its replicas: addresses, last heartbeats, in-flight counts.

Written by the Redis subscriber (or from static config) and read by the service; no I/O.

Invariants:
    * Every membership change goes through ``upsert``/``remove``, which notify the
      routing policy (``update_replicas``, ``on_replica_died``) and drop the replica's
      locality-index entry, so policy, index and membership never disagree for long.
    * ``in_flight[r]`` counts requests this router forwarded to r and not yet finished;
      it never goes negative, and ``total_in_flight()`` is their sum over the current
      replicas (kept as a count, not summed per request).
    * A quarantined replica (it refused a call, or stalled before its first message) is
      never offered to routing while a healthy one is left; it leaves quarantine when a
      probe succeeds (``probe_succeeded``, driven by ``unicache.router.cluster.prober``) or when
      its heartbeat announces a new address (it restarted). Probes are due at
      exponentially growing intervals, ``quarantine_initial_s`` doubling up to
      ``quarantine_max_s``; not at its next heartbeat, since during a Redis outage there
      are none.
    * ``removal_hooks`` run once per replica that leaves (``remove``), so per-replica
      state elsewhere (metric series, first-token estimates) goes with it.
    * ``rec.load`` equals what the heartbeat and ``in_flight`` say (a heartbeat rewrites it
      in place, ``_fill_load``, and its ``in_flight`` moves with the record's), and ``_order``
      is the sorted replica ids: ``loads`` only filters, it builds nothing per replica
      (1,024 replicas: building the snapshot per request cost about 1 ms of CPU).
    * ``_healthy`` is None or ``loads()``'s answer with nothing excluded: every
      membership change, quarantine and release, and every replaced load object clears
      it (a heartbeat updates the record's load object in place, so the common case, a
      request while only heartbeats and in-flight counts move, reuses one list).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.pending import PendingBlocks, PendingView
from unicache.router.cluster.models import ServedModels
from unicache.router.routing.base import LocalityView, ReplicaLoad, RoutingPolicy
from unicache.router.routing.cost_model import CostModel
from unicache.v1 import cache_pb2


@dataclass(slots=True)
class ReplicaRecord:
    replica_id: str
    address: str
    heartbeat: cache_pb2.Heartbeat | None = None
    static: bool = False
    quarantined: bool = False
    probe_at: float = 0.0  # clock time of the next probe while quarantined
    probe_backoff_s: float = 0.0  # interval before that probe (doubles per failed probe)
    last_message: float = 0.0  # time.monotonic() of its last message to this router (any stream)
    in_flight: int = 0  # this router's requests on the replica, not finished yet
    reported_own: int = 0  # of this router's requests in flight when the last load report came, not finished since
    peer_in_flight: int = 0  # the cluster's other routers' (their latest terms-exchange batch)
    routed: int = 0
    load: ReplicaLoad | None = None  # what policies see: rewritten in place per heartbeat, in_flight kept current
    static_hop: str = ""  # a static replica's framed hop address (``--replicas id=addr@hop``)

    @property
    def hop_address(self) -> str:
        """Its framed hop's ``host:port``: from its signed heartbeat, or a static replica's
        ("": none)."""
        hb = self.heartbeat
        return hb.hop_address if hb is not None else self.static_hop

    @property
    def kind(self) -> str:
        """"vllm" for a stock vLLM server (its address is its HTTP base URL), else "replica"."""
        return "vllm" if self.address.startswith(("http://", "https://")) else "replica"

    @property
    def all_in_flight(self) -> int:
        """What policies see as the replica's requests in flight: this router's plus the
        other routers' (``ReplicaLoad.in_flight``)."""
        return self.in_flight + self.peer_in_flight


class EmptyView(LocalityView):
    """An index that knows nothing: what policies see while Redis is unreachable."""

    def match(self, replica_id: str, block_hashes) -> int:  # noqa: ARG002
        return 0

    def prefix_matches(self, block_hashes) -> dict[str, int]:  # noqa: ARG002
        return {}

    def is_stale(self, replica_id: str) -> bool:  # noqa: ARG002
        # NOTE: it vouches for nothing, so policies fall back on their own memory
        # (cache_aware's session stickiness) instead of treating every replica as cold.
        return True


class ClusterView:
    """Live replicas plus the locality index, shared by subscriber and service.

    Args:
        policy: the routing policy to keep informed of membership changes.
        index: the locality index (one per router).
        on_change: optional callback after membership changes (metrics).
        quarantine_initial_s: first probe of a quarantined replica after this (0.5 s).
        quarantine_max_s: bound of the probe interval, which doubles per failed probe (30 s).
        clock: monotonic clock.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        index: LocalityIndex,
        on_change: Callable[[], None] | None = None,
        quarantine_initial_s: float = 0.5,
        quarantine_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < quarantine_initial_s <= quarantine_max_s:
            raise ValueError("need 0 < quarantine_initial_s <= quarantine_max_s")
        self.policy = policy
        self.index = index
        self.quarantine_initial_s = quarantine_initial_s
        self.quarantine_max_s = quarantine_max_s
        self.clock = clock
        self.on_quarantine: list[Callable[[], None]] = []  # called when a replica is newly quarantined (the prober's wake-up)
        self.replicas: dict[str, ReplicaRecord] = {}
        self.redis_connected = False
        self.backend_events = 0  # vLLM backends whose own KV events feed the index
        self.backend_stats: dict[str, dict[str, float]] = {}  # a vLLM backend's last /metrics figures
        self.backend_schema: dict[str, str] = {}  # a vLLM backend's KV event form (vllm_event_schema.SCHEMAS)
        self.models = ServedModels()  # which vLLM backend serves which model and adapter
        # each backend's costs in seconds, learned from its requests and /metrics
        # (``unicache.router.routing.cost_model``): what ``cache_aware`` prices decisions in
        self.cost_model = CostModel()
        self._on_change = on_change
        self._empty = EmptyView()
        # what this router just sent, until the backends' events confirm it (router/cluster/pending.py)
        self.pending = PendingBlocks(held=getattr(index, "held_prefix", None))
        self._pending_views = (PendingView(index, self.pending), PendingView(self._empty, self.pending))
        index.on_stored = index.on_removed = self.pending.confirm
        self.removal_hooks: list[Callable[[str], None]] = []
        self._order: list[str] = []
        self._healthy: list[ReplicaLoad] | None = None  # loads() of the healthy replicas, nothing excluded
        self._in_flight_total = 0  # sum of the records' in_flight

    # --- membership -------------------------------------------------------------------
    def upsert(
        self, replica_id: str, address: str, heartbeat: cache_pb2.Heartbeat | None = None, static: bool = False, hop_address: str = ""
    ) -> bool:
        """Add or refresh a replica (``hop_address``: a static replica's framed hop). Returns
        True when it is new."""
        rec = self.replicas.get(replica_id)
        new = rec is None
        if new:
            rec = self.replicas[replica_id] = ReplicaRecord(replica_id, address, static=static, static_hop=hop_address)
            self._order = sorted(self.replicas)
            self._healthy = None
        if address and address != rec.address:
            # NOTE: a new address is a new process (a restarted replica): the quarantine
            # earned by the old one's refusals does not apply to it.
            if rec.quarantined:
                self._healthy = None
            rec.address, rec.quarantined = address, False
        if heartbeat is not None or rec.load is None:
            if heartbeat is not None:
                rec.heartbeat = heartbeat
            if rec.load is None:
                rec.load = self._load(rec)
                self._healthy = None
            else:
                self._fill_load(rec.load, rec)
        if new:
            self.policy.update_replicas(sorted(self.replicas))
            if self._on_change:
                self._on_change()
        return new

    def remove(self, replica_id: str) -> None:
        """The replica died (heartbeat expired): forget it everywhere."""
        rec = self.replicas.pop(replica_id, None)
        self.pending.drop_replica(replica_id)
        self.models.drop_backend(replica_id)
        if rec is None:
            return
        self._in_flight_total -= rec.in_flight  # its requests' ends will find no record
        self._order = sorted(self.replicas)
        self._healthy = None
        self.index.drop_replica(replica_id)
        self.policy.on_replica_died(replica_id)
        self.policy.update_replicas(sorted(self.replicas))
        for hook in self.removal_hooks:
            hook(replica_id)
        if self._on_change:
            self._on_change()

    # --- what the service reads -------------------------------------------------------
    def locality(self) -> LocalityView:
        """The index, or an empty view when nothing feeds it: Redis is unreachable and no
        vLLM backend sends its own events (session + load routing); either with the blocks
        this router routed and no event confirmed yet counted past each replica's match
        (``unicache.router.cluster.pending``)."""
        fed = self.redis_connected or self.backend_events
        if self.pending:  # blocks routed and not confirmed yet count too, Redis or not
            return self._pending_views[0 if fed else 1]
        return self.index if fed else self._empty

    def loads(self, exclude: set[str] | frozenset[str] = frozenset(), quarantined: bool = False) -> list[ReplicaLoad]:
        """Loads of the healthy replicas not in ``exclude``, by id; ``quarantined``: of
        the quarantined ones instead (the last resort when no healthy one is left).

        NOTE: the records' own load objects, current as of now: read them during one
        choice, never keep them (their ``in_flight`` moves with the router's); with
        nothing excluded, the list itself is kept between calls (``_healthy``): never
        change it."""
        if not exclude and not quarantined:
            healthy = self._healthy
            if healthy is None:
                replicas = self.replicas
                healthy = self._healthy = [replicas[rid].load for rid in self._order if not replicas[rid].quarantined]
            return healthy
        replicas = self.replicas
        return [rec.load for rid in self._order
                if (rec := replicas[rid]).quarantined == quarantined and rid not in exclude]

    def all_loads(self) -> list[ReplicaLoad]:
        """Every replica's load, quarantined or not (for metrics and state pages)."""
        return [self.replicas[rid].load for rid in self._order]

    @staticmethod
    def _load(rec: ReplicaRecord) -> ReplicaLoad:
        """A new load object for ``rec`` (``_fill_load``)."""
        load = ReplicaLoad(rec.replica_id)
        ClusterView._fill_load(load, rec)
        return load

    @staticmethod
    def _fill_load(load: ReplicaLoad, rec: ReplicaRecord) -> None:
        """Write ``rec``'s heartbeat figures (none before its first) and its in-flight
        count into ``load``, in place."""
        hb = rec.heartbeat
        if hb is not None:
            load.running, load.waiting, load.queued_prefill_tokens = hb.running, hb.waiting, hb.queued_prefill_tokens
            load.free_blocks, load.capacity_blocks = hb.cache.free_blocks, hb.cache.capacity_blocks
            rec.reported_own = rec.in_flight
        load.in_flight = rec.all_in_flight

    def set_external_load(self, replica_id: str, running: int, waiting: int, free_blocks: int, capacity_blocks: int) -> None:
        """A vLLM backend's load from its ``/metrics`` (what a heartbeat gives for a replica),
        written in place; the router's own in-flight count is kept."""
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.load is not None:
            load = rec.load
            load.running, load.waiting = running, waiting
            load.free_blocks, load.capacity_blocks = free_blocks, capacity_blocks
            rec.reported_own = rec.in_flight

    def healthy(self, replica_id: str) -> bool:
        rec = self.replicas.get(replica_id)
        return rec is not None and not rec.quarantined

    # --- quarantine ---------------------------------------------------------------------
    def quarantine(self, replica_id: str) -> bool:
        """Stop routing to the replica until a probe succeeds; the first probe is due
        ``quarantine_initial_s`` from now. Returns True when it was not quarantined yet
        (a quarantined replica keeps its probe schedule)."""
        rec = self.replicas.get(replica_id)
        if rec is None or rec.quarantined:
            return False
        rec.quarantined = True
        self._healthy = None
        rec.probe_backoff_s = self.quarantine_initial_s
        rec.probe_at = self.clock() + rec.probe_backoff_s
        for wake in self.on_quarantine:
            wake()
        return True

    def probes_due(self) -> list[tuple[str, str]]:
        """(replica id, address) of every quarantined replica whose probe is due now."""
        now = self.clock()
        return [(r.replica_id, r.address) for r in self.replicas.values() if r.quarantined and r.probe_at <= now]

    def next_probe_at(self) -> float | None:
        """Clock time of the earliest scheduled probe (None: nothing is quarantined)."""
        return min((r.probe_at for r in self.replicas.values() if r.quarantined), default=None)

    def probe_succeeded(self, replica_id: str) -> None:
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.quarantined:
            rec.quarantined = False
            self._healthy = None

    def probe_failed(self, replica_id: str) -> None:
        """Double the interval to the next probe, up to ``quarantine_max_s``."""
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.quarantined:
            rec.probe_backoff_s = min(rec.probe_backoff_s * 2, self.quarantine_max_s)
            rec.probe_at = self.clock() + rec.probe_backoff_s

    def started(self, replica_id: str, prompt_tokens: int = 0) -> None:
        """One of this router's requests, of ``prompt_tokens`` prompt tokens, was sent to
        ``replica_id``. A stock vLLM server reports no queued prompt tokens; there the
        router counts its own requests' until each one's ``prefilled``."""
        rec = self.replicas.get(replica_id)
        if rec is not None:
            rec.in_flight += 1
            self._in_flight_total += 1
            load = rec.load
            load.in_flight = rec.all_in_flight
            rec.routed += 1
            if prompt_tokens and rec.kind == "vllm":
                load.queued_prefill_tokens += prompt_tokens

    def prefilled(self, replica_id: str, prompt_tokens: int) -> None:
        """The request ``started`` with ``prompt_tokens`` sent its first token, or ended
        without one: it leaves a vLLM server's queued prompt tokens (never below 0).
        Invariant: called once per ``started`` request, so a vLLM server's
        ``queued_prefill_tokens`` is the prompt tokens of this router's requests there
        without a first token yet."""
        rec = self.replicas.get(replica_id)
        if rec is not None and prompt_tokens and rec.kind == "vllm":
            load = rec.load
            load.queued_prefill_tokens = max(0, load.queued_prefill_tokens - prompt_tokens)

    def finished(self, replica_id: str) -> None:
        """One of this router's requests on ``replica_id`` ended. A load report (heartbeat,
        ``/metrics``: up to its interval old) counted the requests of ours then in flight;
        as each of those ends it comes off the report's running (else waiting) count, so a
        stale report does not keep a replica looking busier than it is until the next one.
        Invariant: ``reported_own <= in_flight``, and the counts never go below 0."""
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.in_flight > 0:
            rec.in_flight -= 1
            self._in_flight_total -= 1
            load = rec.load
            load.in_flight = rec.all_in_flight
            if rec.reported_own > 0:
                rec.reported_own -= 1
                if load.running > 0:
                    load.running -= 1
                elif load.waiting > 0:
                    load.waiting -= 1

    def total_in_flight(self) -> int:
        """This router's requests in flight (what its ``max_in_flight`` bounds), on the
        replicas it still knows."""
        return self._in_flight_total

    def own_in_flight(self) -> dict[str, int]:
        """This router's requests in flight per replica, where not 0 (what it tells the
        cluster's other routers, ``unicache.router.cluster.terms_exchange``)."""
        return {rid: r.in_flight for rid, r in self.replicas.items() if r.in_flight}

    def set_peer_in_flight(self, counts: dict[str, int]) -> None:
        """The other routers' requests in flight per replica (absent: 0); policies see
        each replica's ``in_flight`` as this router's plus theirs."""
        for rid, rec in self.replicas.items():
            n = counts.get(rid, 0)
            if n != rec.peer_in_flight:
                rec.peer_in_flight = n
                if rec.load is not None:
                    rec.load.in_flight = rec.all_in_flight
