"""The routing policy plug-in interface, shared by the live router and the simulator.

A policy sees the request (its class and chained block hashes), a snapshot of every
live replica's load, and the locality index (which prefix blocks each replica is
believed to hold). It returns one decision. The live router and ``unicache sim
--replicas N --router NAME`` run the very same policy objects.

``RoutingPolicy`` is what every policy implements: ``choose`` and lifecycle hooks.
``SharesRouterState`` is an optional capability, checked with ``isinstance``: a policy
whose session memory and traffic-derived terms the routers of a cluster share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple, Protocol, runtime_checkable

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass


@dataclass(slots=True)
class ReplicaLoad:
    """A replica's load as the router sees it (heartbeat plus the router's own in-flight count).

    Attributes:
        replica_id: stable id of the replica.
        running: requests decoding or prefilling now.
        waiting: requests queued at the replica.
        queued_prefill_tokens: the whole prompt tokens of the requests admitted that
            have no first token yet, waiting or being prefilled (cached parts included:
            every engine, and the simulator, learns the match only when it schedules the
            request).
        free_blocks: blocks that can be allocated now (uncached free + evictable).
        capacity_blocks: total KV blocks.
        in_flight: requests this router sent that have not finished (with the terms
            exchange, plus those the cluster's other routers last said they have there).
    """

    replica_id: str
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    capacity_blocks: int = 0
    in_flight: int = 0

    @property
    def outstanding(self) -> int:
        """The load measure most policies compare: max of router and replica views."""
        return max(self.in_flight, self.running + self.waiting)


# ``replica_id_of(load)`` is ``load.replica_id``, callable at C speed (``map`` over a fleet).
replica_id_of = attrgetter("replica_id")


class TierRun(NamedTuple):
    """What a replica's two tiers hold past its GPU prefix, as its store would use it.

    ``length`` consecutive blocks from the end of the GPU prefix; the first is in the
    host tier, each later one in the host tier or on the GPU (a policy may evict a
    parent and keep its child, so the GPU chain can resume after host blocks).
    ``gpu_at``: the absolute prompt positions, ascending, of the run's blocks held on
    the GPU (shared like the prefix); the others are host blocks, promoted by a copy.
    """

    length: int
    gpu_at: tuple[int, ...] = ()

    @property
    def host_blocks(self) -> int:
        return self.length - len(self.gpu_at)


NO_RUN = TierRun(0)


@dataclass(slots=True)
class RoutingRequest:
    """What a policy knows about one request."""

    request_id: str
    cls: RequestClass
    block_hashes: list[BlockHash]
    num_prompt_tokens: int
    block_size: int


@dataclass(slots=True, frozen=True)
class RouteDecision:
    """The chosen replica and why (``reason`` is a short label used in metrics)."""

    replica_id: str
    reason: str
    matched_blocks: int = 0
    score: float = 0.0


def uncached_tokens(request: RoutingRequest, decision: RouteDecision) -> int:
    """The prompt tokens of ``request`` that ``decision``'s replica has not cached (its
    index match counted in whole blocks; never negative)."""
    return max(0, request.num_prompt_tokens - decision.matched_blocks * request.block_size)


@dataclass(slots=True)
class SessionRecord:
    """A session's latest turn as a policy remembers it, in the form routers share
    (``unicache.router.cluster.session_store``): where the turn went, its prompt's chained
    hashes, and whether the index had confirmed the session's prefix there."""

    replica_id: str
    hashes: list[BlockHash]
    confirmed: bool = False
    routed_at: int | None = None  # the writer's routed-request clock at the turn (None: unknown)


class RoutedEvent(NamedTuple):
    """What one routing decision did to a policy's traffic-derived state, in the form
    routers exchange it (``unicache.router.cluster.terms_exchange``): every router applies every
    router's events, so each holds the terms one router routing all the traffic would.

    ``new_tokens``: the request's uncached prompt tokens sent to ``replica_id`` (churn's
    inflow); ``session_blocks``: the prompt blocks of an explicit session's turn (0: no
    session), added to the replica's session footprint; ``prev_replica_id`` /
    ``prev_share``: where that session's previous turn went and the footprint it still
    held there, taken out ("" / 0: no previous turn known). A named tuple: one is made
    per routed request.
    """

    replica_id: str
    new_tokens: int = 0
    session_blocks: int = 0
    prev_replica_id: str = ""
    prev_share: float = 0.0


class LocalityView(ABC):
    """Read-only view of which prefix blocks each replica holds (``unicache.router.cluster.index``)."""

    @abstractmethod
    def match(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading ``block_hashes`` the replica holds."""

    @abstractmethod
    def prefix_matches(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Every replica holding at least the first of ``block_hashes``, with the number
        of leading blocks it holds (a replica left out matches 0). Policies call this
        once per decision instead of ``match`` per replica: the index walks the prefix
        through its hash -> replicas map and never visits a replica that matches nothing."""

    def prefix_match_groups(self, block_hashes: Sequence[BlockHash],
                            wide: int) -> tuple[dict[str, int], list[tuple[int, frozenset[str] | set[str]]]]:
        """``prefix_matches`` split in two for a large fleet: ``(deep, groups)``. While more
        than ``wide`` replicas hold the prefix so far, the ones that stop at each length
        form a group ``(length, replica ids)``; the at most ``wide`` that go on are
        walked one by one into ``deep``. Every holder of the first block is in exactly
        one of them, at its ``prefix_matches`` length. Default: no groups (exact, at the
        cost of ``prefix_matches``)."""
        return self.prefix_matches(block_hashes), []

    def tier_run(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int) -> TierRun:
        """The run of ``block_hashes[start:]`` that the replica's two tiers hold together,
        as its KV store matches it past a GPU prefix of ``start`` blocks (``KVStore
        ._tier_run``): the first block is in the host tier, later ones in either.
        Default: empty (a view without tiers)."""
        return NO_RUN

    def tier_runs(self, block_hashes: Sequence[BlockHash], gpu_matches: dict[str, int],
                  groups: Sequence[tuple[int, Collection[str]]] = ()) -> dict[str, TierRun]:
        """``tier_run(r, block_hashes, m_r)`` for every replica where it is not empty (left
        out: empty), in one call, where m_r is r's GPU match: ``gpu_matches[r]``, else the
        length of the ``prefix_match_groups`` group r is in, else 0. An index keyed by
        hash visits only the replicas whose host tier holds the block after their GPU
        match. Default: no tiers."""
        return {}

    def match_all(self, replica_ids: Sequence[str], block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {r: self.match(r, block_hashes) for r in replica_ids}

    def is_stale(self, replica_id: str) -> bool:
        """True when the view cannot vouch for the replica's holdings (never synced, or a
        resync is pending, e.g. while Redis is down). Policies may then trust their own
        memory (session stickiness) over ``match``."""
        return False


class RoutingPolicy(ABC):
    """Chooses a replica per request. Lifecycle hooks keep policy-private state current.

    ``choose`` is the one required method; the hooks default to doing nothing. The
    router and the simulator call them in this order per request: ``choose``,
    ``on_request_routed``, ``on_first_token``, ``on_request_finished``; membership
    changes reach the policy through ``update_replicas`` and ``on_replica_died``. A policy
    whose state other routers share implements ``SharesRouterState`` as well.

    ``choose`` is only called with a non-empty ``replicas`` list.
    """

    name: str = "base"

    @abstractmethod
    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision: ...

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        """The set of live replicas changed."""

    def on_request_routed(self, request: RoutingRequest, decision: RouteDecision) -> None:
        """Called after ``choose`` once the request was sent."""

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None:
        """``replica_id`` sent the request's first token: its prefill is done (the live
        router: the replica's first message; the simulator: the end of its prefill)."""

    def on_request_finished(self, request: RoutingRequest, replica_id: str) -> None:
        """The request completed (or failed) on ``replica_id``."""

    def on_replica_died(self, replica_id: str) -> None:
        """The replica's heartbeat expired or its stream failed."""


@runtime_checkable
class SharesRouterState(Protocol):
    """The optional capability of a policy whose state several routers of one cluster share
    (several processes or pods): its session memory and its traffic-derived terms.

    Checked with ``isinstance(policy, SharesRouterState)`` where the router wires the
    session store (``unicache.router.cluster.session_store``) and the terms exchange
    (``unicache.router.cluster.terms_exchange``); a policy without it shares nothing (the router
    then makes no Redis calls for it), and its choices do not depend on what another
    router saw.
    """

    # Sessions: before choosing for a request of session ``key`` (``keys.session_key``)
    # the router imports the cluster's record of it; after routing it exports the policy's.
    def export_session(self, key: str) -> SessionRecord | None:
        """The policy's record of session ``key`` (None: it remembers none)."""
        ...

    def import_session(self, key: str, record: SessionRecord) -> None:
        """Adopt ``record`` (written by any router) as the session's latest turn."""
        ...

    # Traffic-derived terms: once ``share_terms`` is called, ``take_routed`` drains this
    # router's decisions as events and ``apply_routed`` applies the other routers'.
    def share_terms(self) -> bool:
        """Start recording routed events for the other routers; False when the policy has
        no such terms (then the router exchanges nothing)."""
        ...

    def take_routed(self) -> list[RoutedEvent]:
        """This router's routed events since the last call (oldest first)."""
        ...

    def apply_routed(self, events: Sequence[RoutedEvent]) -> None:
        """Apply other routers' routed events, oldest first, as if routed here."""
        ...

    # Queued prompt tokens: each router's sums travel with its batches; the policy weighs
    # the cluster's (its own plus ``set_peer_queued``'s).
    def queued_tokens(self) -> dict[str, tuple[int, int]]:
        """Per replica, the uncached and whole prompt tokens of this router's requests
        routed there and without their first token yet."""
        ...

    def take_queued_changes(self) -> dict[str, tuple[int, int]]:
        """``queued_tokens``' entries that changed since the last call, (0, 0) for a
        replica whose sums fell to nothing (the terms exchange's deltas, once ``share_terms``
        is on; empty: none)."""
        ...

    def set_peer_queued(self, totals: dict[str, tuple[int, int]]) -> None:
        """The other routers' ``queued_tokens``, summed per replica (replaces the last)."""
        ...

    def queue_shares(self) -> dict[str, float] | None:
        """Per replica, the uncached share of its queue the policy weighs (a replica left
        out: 1, nothing known to wait there; None: no such share); the router's
        ``unicache_router_replica_queue_share`` gauge shows it."""
        ...
