"""``cache_aware`` (ours): minimise an estimate of each replica's time to first token,
while keeping the replicas' cache churn even.

One decision, for a request of N prompt tokens in L blocks of B tokens (chained block
hashes h[0..L)), over the live replicas r offered to ``choose``::

    fleet --> candidates --> admissible --> session home? --yes--> its replica
                                                  | no
                                                  v
                                    fit (with room) --> argmin cost_r

The decision has five stages (methods of ``CacheAwarePolicy``, in this order):

1. ``_candidates``: the replicas weighed. Up to ``candidate_window`` replicas, the
   whole fleet. Beyond it, the replicas that could hit the prompt (the index's holders
   of its first block, host-tier runs, blocks in flight, the session's replica, the
   template's home), the fleet's least-queued replica and a window of
   ``candidate_window`` others that moves with each routed request
   (``unicache.router.routing.cache_aware.candidates``). A prefix more than half the fleet holds sets
   no replica apart: ``LocalityView.prefix_match_groups`` groups its holders by length,
   weighed only where the window brings them in (``matches_of_candidates``). When the
   holders alone decide admission (``TTFTAdmission.decided_by_matches``) they are the
   candidates, exactly as over the whole fleet.
2. ``_admission``: the replicas whose estimated TTFT is within ``admission_factor`` of
   the best one's (``unicache.router.routing.cache_aware.admission``):
       est_r = uncached prompt tokens by the index + q_r * queued_prefill_tokens_r / lanes
   a hard guard: locality never makes a request wait longer than recomputing its prefix
   elsewhere. A *saturated* replica is taken out: one whose estimate plus
   ``request_cost_tokens`` per request it has not started (outstanding_r - running_r)
   is beyond ``admission_factor`` of the least such sum; when that leaves none, the
   replicas within the factor of that least sum are admissible. This is how a hot
   session or prefix overflows (issue 39): its holder estimates near 0 and a queue of
   its own cached traffic adds near 0 (q_r), so nothing else was ever admissible there.
3. ``_session_home`` (``session_sticky``): a turn of an explicit session with a
   remembered previous turn goes to that turn's replica (reason ``session_home``;
   ``session_sticky`` while the view is stale for it) unless the replica is not
   admissible (dead, saturated, a long queue, or another replica so much faster) or
   lost the session's blocks: the view is fresh, it once showed at least
   ``session_hold_frac`` of the session's prefix there (the session is *confirmed*) and
   now shows less. An unconfirmed session stays home on a miss: a fresh-looking index
   can lag the replica by one event flush.
4. ``_fit`` (``fit_first``): of the admissible replicas, those with room for the request's
   blocks, when any has (``with_room``: free_blocks_r - queued_prefill_tokens_r / B >=
   ceil(N / B)). After the session home: a moved turn recomputes its context.
5. ``_score``: argmin cost_r over what is left; ties to the less loaded (``load_key``).

Names the cost uses, per replica r:

    m_r      = blocks of h the replica holds or will hold, max of:
                 index    = LocalityView.prefix_matches(h)[r]  (published holdings)
                 inflight = index extended while h[i] is in a prompt routed to r and not
                            finished yet (only with ``track_inflight``)
                 sticky   = sticky_trust * k on the session's last replica, k = common
                            prefix with the session's previous turn, only while the view
                            is stale for r (``LocalityView.is_stale``: Redis down, resync)
                 home     = template_trust * template_blocks on the template's home, the
                            owner of h[k - 1], k = min(template_blocks,
                            template_key_blocks), on a consistent-hash ring
    p_r      = min(1, (queued_prefill_tokens_r / B) / max(1, free_blocks_r))
               (eviction pressure: the share of r's evictable blocks that work already
               queued there claims before this request is admitted)
    run_r    = the run that continues the index match through both tiers
               (``LocalityView.tier_runs``: its first block on the host, later ones on
               the host or the GPU, as the replica's store matches)
    g_r, h_r = of run_r's blocks past m_r, those on the GPU (full hits) and those on the
               host (promoted: their KV copied from host memory)
    hit_r    = B * (m_r + g_r + (1 - host_cost) * h_r) * (1 - evict_weight * p_r)
    q_r      = the uncached share of r's queue (``queue_share``): of the requests this
               router (sharing terms: every router) routed to r without a first token
               yet, uncached prompt tokens at routing over whole prompt tokens; 1 when
               there are none (replicas publish their queue as whole prompts)
    load_r   = q_r * queued_prefill_tokens_r / lanes + request_cost_tokens * outstanding_r
               (lanes = prefill_lanes with ``queue_per_lane``, else 1)
    churn_r  = N * max(0, inflow_r / mean(inflow) - 1), inflow_r = uncached prompt tokens
               routed to r, decayed by (1 - 1/W) per routed request,
               W = max(churn_window, CHURN_WINDOW_PER_REPLICA x live replicas)
    foot_r   = N * F_r / capacity_blocks_r, F_r = the prompt blocks of each session's
               latest turn routed to r, decayed by (1 - 1/footprint_window) per routed
               request, leaving out the request's own session (0 when the capacity is
               unknown)

    cost_r   = (N - hit_r) + load_weight * load_r + churn_weight * churn_r
               + footprint_weight * foot_r

Priced in seconds: with a cost model (``unicache.router.routing.cost_model``) that has
fitted some backend, each replica's terms are priced in its own seconds, a_r, b_r, s_r
its fitted prefill base, seconds per prefill token and seconds per outstanding request:

    cost_r   = a_r + b_r * (N - hit_r) + load_weight * (b_r * q_r * queued_prefill_tokens_r / lanes
               + s_r * outstanding_r) + b_r * (churn_weight * churn_r + footprint_weight * foot_r)

the expected TTFT there (the drain of what runs and waits, then the request's uncached
prefill), with eviction pressure (in hit_r), churn and the session footprint priced as
the prefill they would cost on r. TTFT admission estimates in the same seconds
(``TTFTAdmission.admissible_timed``), so a session's home is bounded by the same price.
Where a cached block saves little against what a request waits behind another (b_r small
beside s_r) the choice is the least loaded one; where it saves much it follows the cache.
Until a backend is fitted the prices are token units (a = 0, b = 1, s =
``request_cost_tokens``), the formula above.

Why the terms: churn is a flow (new blocks per request: what evicts cached blocks and
the prefill work a replica computes), a live session's context is a stock that stays
cached between its turns (the footprint); without the footprint term unrelated work
lands beside long agent sessions and the two evict each other. Task and template
locality come mostly from chained hashes (requests of one template share leading
hashes); ``inflight`` and ``home`` cover what the index cannot know yet, and the sticky
floor keeps sessions in place while the index is unavailable. The home is keyed on the
template's first ``template_key_blocks`` blocks, not its last, because a template's
known extent grows as it warms. The defaults (``CacheAwareConfig``) and the
measurements that chose them are in docs/routing.md.

Invariants:
    * Router-side state is bounded: at most ``max_sessions`` sessions holding at most
      ``max_session_blocks`` hashes in all (``session_blocks``), and ``max_inflight``
      tracked requests (oldest dropped first).
    * ``_footprint.get(r)`` is the decayed sum, over the remembered sessions whose latest
      turn went to r, of that turn's prompt blocks (a forgotten session's share is
      taken out; it never goes below 0). Sharing terms (``share_terms``), the sum runs
      over the sessions whose latest turn any router of the cluster sent to r, as their
      routed events said, and ``_inflow`` and the clock ``_routed`` count every router's
      requests too.
    * ``_queues`` (``QueueShares``) holds at most ``max_inflight`` requests routed and
      without their first token yet, their sums per replica and the shares those give
      with the other routers' sums (``set_peer_queued``, the terms exchange).
    * A replica that died or left holds no pending blocks, queued requests, sessions,
      inflow, footprint or ring points.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import repeat

from unicache.contract.block_hash import BlockHash
from unicache.router.routing.cache_aware.admission import TTFTAdmission
from unicache.router.routing.base import (
    LocalityView, ReplicaLoad, RouteDecision, RoutedEvent, RoutingPolicy, RoutingRequest, SessionRecord, replica_id_of,
    uncached_tokens,
)
from unicache.router.routing.cache_aware.candidates import CandidateWindow
from unicache.router.routing.cache_aware.decaying import DecayingTotals
from unicache.router.routing.cache_aware.queue_share import QueueShares
from unicache.router.routing.cost_model import CostModel
from unicache.router.routing.keys import HashRing, load_key, session_key
from unicache.router.routing.registry import register_routing_policy




def with_room(replicas: list[ReplicaLoad], num_prompt_tokens: int, block_size: int) -> list[ReplicaLoad]:
    """The replicas whose free blocks (free plus evictable cached ones) hold the request's
    prompt blocks beyond what their waiting requests need,

        free_blocks_r - queued_prefill_tokens_r / B >= ceil(N / B)

    (a matched block leaves the evictable pool too, so cached ones count); all of
    ``replicas`` when none has room (nothing to prefer: every one makes the request wait),
    in their order."""
    need = -(-num_prompt_tokens // block_size)
    room = [r for r in replicas if r.free_blocks - r.queued_prefill_tokens / block_size >= need]
    return room or replicas


def matches_of_candidates(deep: dict[str, int], groups: Sequence[tuple[int, Collection[str]]],
                          candidates: Sequence[ReplicaLoad]) -> dict[str, int]:
    """``prefix_matches`` for the replicas ``LocalityView.prefix_match_groups`` split into
    ``deep`` and ``groups``, for ``deep``'s replicas and the candidates only (a candidate
    in no group and not in ``deep`` matches nothing, and is left out as
    ``prefix_matches`` leaves it out)."""
    out = dict(deep)
    for r in candidates:
        rid = r.replica_id
        if rid not in out:
            for length, ids in groups:
                if rid in ids:
                    out[rid] = length
                    break
    return out


def common_prefix_blocks(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Length of the common prefix of two chained hash lists, by binary search.

    Chained hashes name whole prefixes, so ``a[i] == b[i]`` implies equality before i.
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# The churn window scales with the fleet beyond 8 replicas: the default window (256
# requests) holds 32 requests per replica at 8, the largest fleet the defaults were chosen
# at. With a fixed window in a large fleet most replicas have no inflow in it, and one that
# has just taken a new prompt stands at hundreds of times the mean, so the churn term
# outweighs any prefix hit there (docs/routing.md, the ``churn_window_fleet`` study).
CHURN_WINDOW_PER_REPLICA = 32
_INF = float("inf")


@dataclass(slots=True)
class _Session:
    """A session's latest turn: where it went, its prompt hashes, and when (``_routed``);
    ``confirmed``: the index has shown the session's prefix on that replica."""

    replica_id: str
    hashes: list[BlockHash]
    routed_at: int
    confirmed: bool = False


@dataclass(slots=True)
class _InFlight:
    replica_id: str
    hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """``CacheAwarePolicy``'s tunables: what an operator may set, with the defaults the
    policy was tuned at (why each default: docs/routing.md). Frozen; ``__post_init__``
    refuses a value out of range with a ValueError naming the field.

    Attributes:
        load_weight: tokens of cost per token of work queued ahead (default 1.0).
        request_cost_tokens: work, in prompt tokens, one outstanding request stands for
            (default 128).
        evict_weight: how much full eviction pressure discounts a matched block (0.5).
        host_cost: a promoted token's cost in prefilled tokens: H2D copy time per token
            over prefill time per token (default 0.08; ``unicache.sim.timing``). 1 ignores
            host tiers.
        sticky_trust: share of the previous turn's prefix credited to the session's
            last replica while the view is stale for it (default 0.5).
        template_trust: share of a template's blocks credited to its home (default 0.1).
        churn_weight: weight of the churn term, in units of the request's tokens per unit
            of relative excess inflow (default 0.5; 0 turns it off).
        churn_window: inflow decays by 1 - 1/W per routed request, W = max(churn_window,
            ``CHURN_WINDOW_PER_REPLICA`` x live replicas) (256: the window up to 8 replicas;
            larger fleets keep its 32 requests per replica).
        footprint_weight: weight of the session footprint term, in units of the
            request's tokens per replica cache share (default 0.5; 0 turns it off).
        footprint_window: a session's footprint decays by 1 - 1/footprint_window per
            routed request (default 96).
        track_inflight: count blocks of unfinished requests as held (default False).
        admission_factor: a replica is admissible while its estimated TTFT is at most
            this times the best replica's and it is not saturated (default 2.0;
            ``TTFTAdmission``, whose ``wait_cost`` is ``request_cost_tokens``).
        prefill_lanes: what a replica's queue is divided by in the TTFT estimate and the
            load term (default 4, the simulator's prefill lanes).
        session_sticky: a session's next turn goes to its previous turn's replica unless
            that replica is dead, not admissible or lost the session's blocks (default
            True; False leaves sessions to the cost).
        session_hold_frac: the share of the session's prefix (common prefix with its
            previous turn) the index must show on the home replica for it to count as
            holding the session (default 0.5).
        fit_first: of the admissible replicas, consider only those with free blocks for
            the request's prompt beyond what their queues need (``with_room``), when any
            has; a session's home is judged before this (default True).
        queue_share: weigh each replica's queue in the admission estimate and the load
            term by ``q_r``, the uncached share of the requests waiting there that this
            router (with the terms exchange: every router) sent (default True; False:
            whole prompts, as replicas publish them). Fit-first's room and the eviction
            pressure keep whole prompts: a queued request claims its cached blocks too.
        queue_per_lane: the load term counts the queue over ``prefill_lanes`` (default
            True; False: the whole queue).
        virtual_nodes: points per replica on the template ring (default 160).
        template_key_blocks: the home is the ring owner of the hash of block
            min(template_blocks, template_key_blocks) - 1 (default 1: the first block, a
            key that stays put while the template's known extent grows; 0: the template's
            last block).
        max_sessions / max_inflight: bounds on router-side state (default 100,000 each).
        max_session_blocks: bound on the prompt hashes the remembered sessions hold in all
            (default 4,000,000; the router derives it from its memory budget,
            ``unicache.router.memory``).
        candidate_window: in a fleet of more than this many replicas, a decision weighs
            the replicas that could hit the prompt and this many others, a window that
            moves with each routed request (``unicache.router.routing.cache_aware.candidates``;
            default 32; 0: every replica). Fleets up to it decide as without it.
    """

    load_weight: float = 1.0
    request_cost_tokens: float = 128.0
    evict_weight: float = 0.5
    host_cost: float = 0.08
    sticky_trust: float = 0.5
    template_trust: float = 0.1
    churn_weight: float = 0.5
    churn_window: int = 256
    footprint_weight: float = 0.5
    footprint_window: int = 96
    track_inflight: bool = False
    admission_factor: float = 2.0
    prefill_lanes: int = 4
    session_sticky: bool = True
    session_hold_frac: float = 0.5
    fit_first: bool = True
    queue_share: bool = True
    queue_per_lane: bool = True
    virtual_nodes: int = 160
    template_key_blocks: int = 1
    max_sessions: int = 100_000
    max_inflight: int = 100_000
    max_session_blocks: int = 4_000_000
    candidate_window: int = 32

    def __post_init__(self) -> None:
        if self.churn_window <= 0 or self.footprint_window <= 0:
            raise ValueError("churn_window and footprint_window must be positive")
        if self.template_key_blocks < 0:
            raise ValueError("template_key_blocks must be >= 0")
        if not 0.0 <= self.session_hold_frac <= 1.0:
            raise ValueError("session_hold_frac must be in [0, 1]")
        if not 0.0 <= self.host_cost <= 1.0:
            raise ValueError("host_cost must be in [0, 1]")
        if not self.admission_factor >= 1.0:
            raise ValueError(f"admission_factor must be >= 1, got {self.admission_factor}")
        if self.prefill_lanes < 1:
            raise ValueError(f"prefill_lanes must be >= 1, got {self.prefill_lanes}")
        if self.virtual_nodes <= 0:
            raise ValueError(f"virtual_nodes must be positive, got {self.virtual_nodes}")
        if self.candidate_window < 0:
            raise ValueError(f"candidate_window must be >= 0 (0: every replica), got {self.candidate_window}")


@dataclass(slots=True)
class _Candidates:
    """What the candidates stage hands the later ones: the replicas weighed, their index
    matches, the admissible set when the holders alone decided it (else None), the
    template home when it was needed already, and the host-tier runs when looked up
    (``runs_known``; None: no tiers)."""

    replicas: Sequence[ReplicaLoad]
    matches: dict[str, int]
    admissible: list[ReplicaLoad] | None = None
    template_home: tuple[str | None, float] | None = None
    runs_known: bool = False
    runs: dict | None = None


@register_routing_policy("cache_aware")
class CacheAwarePolicy(RoutingPolicy):
    """Prefix locality against load and churn, with stickiness, template homes and
    eviction risk; the formula and the stages of a decision are in the module docstring.
    Implements ``SharesRouterState``: several routers share its sessions and
    traffic-derived terms.

    Args:
        config: the tunables (default ``CacheAwareConfig()``). The policy's attributes of
            the same names hold them, as the decision reads them per request.
        cost_model: the backends' costs in seconds (``unicache.router.routing.cost_model``;
            ``set_cost_model``). While it has fitted no backend, or without one, the
            decision is priced in prefill tokens (module docstring, "Priced in seconds").
    """

    config_class = CacheAwareConfig

    def __init__(self, config: CacheAwareConfig | None = None, cost_model: CostModel | None = None):
        if config is None:
            config = CacheAwareConfig()
        elif not isinstance(config, CacheAwareConfig):
            raise TypeError(f"CacheAwarePolicy takes a CacheAwareConfig, got {type(config).__name__}")
        self.config = config
        self.admission = TTFTAdmission(config.admission_factor, config.prefill_lanes, config.request_cost_tokens)
        self.session_blocks = 0  # hashes held by the remembered sessions
        self.ring = HashRing(config.virtual_nodes)
        self._decay = 1.0 - 1.0 / config.churn_window
        self._inflow = DecayingTotals()
        self._foot_decay = 1.0 - 1.0 / config.footprint_window
        self._footprint = DecayingTotals()
        self._routed = 0  # requests routed so far (by every router, when sharing terms): the decays' clock
        self._outbox: list[RoutedEvent] | None = None  # this router's events, when sharing terms
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._inflight: OrderedDict[str, _InFlight] = OrderedDict()
        self._pending: dict[str, dict[BlockHash, int]] = {}
        self._queues = QueueShares(config.max_inflight)
        self._window = CandidateWindow(config.candidate_window)
        self.cost_model = cost_model

    def set_cost_model(self, model: CostModel | None) -> None:
        """Price decisions with ``model`` (the router's live one, or a calibration)."""
        self.cost_model = model

    def _timed(self) -> CostModel | None:
        """The cost model when it prices backends apart (some backend is fitted), else None."""
        model = self.cost_model
        return model if model is not None and not model.uniform else None

    # -- decision: the stages the module docstring names, in order ----------------------

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        cls = request.cls
        prev = self._sessions.get(session_key(cls.tenant, cls.session_id)) if cls.session_id is not None else None
        timed = self._timed()
        cand = self._candidates(request, replicas, index, prev, timed)
        admissible = cand.admissible
        if admissible is None:
            if timed is not None:
                admissible = self.admission.admissible_timed(cand.replicas, request.num_prompt_tokens, request.block_size,
                                                             cand.matches, self._queues.share, timed.costs)
            else:
                admissible = self._admission(cand.replicas, request.num_prompt_tokens, request.block_size, cand.matches)
        if prev is not None and self.config.session_sticky:
            kept = self._session_home(prev, request.block_hashes, admissible, index, cand.matches)
            if kept is not None:
                return kept
        if self.config.fit_first:
            admissible = self._fit(admissible, request.num_prompt_tokens, request.block_size)
        return self._score(request, replicas, admissible, index, cand, prev, timed)

    def _candidates(self, request: RoutingRequest, fleet: Sequence[ReplicaLoad], index: LocalityView,
                    prev: _Session | None, timed: CostModel | None = None) -> _Candidates:
        """Stage 1: the replicas a decision weighs and their index matches. The whole fleet
        up to ``candidate_window`` replicas; beyond it, the holders alone when TTFT
        admission can decide among them (then the admissible set comes with them), else
        the replicas that could hit the prompt plus a moving window of the others
        (``unicache.router.routing.cache_aware.candidates``)."""
        hashes = request.block_hashes
        window = self._window
        if not window.applies(len(fleet)):
            return _Candidates(fleet, index.prefix_matches(hashes))  # NOTE: one walk; replicas left out match 0
        # a large fleet. A prefix more than half the fleet holds (a system prompt
        # everywhere) sets no replica apart: its holders come grouped by length, and
        # count only where the window below or another reason brings them in
        matches, groups = index.prefix_match_groups(hashes, len(fleet) // 2)
        if not groups and timed is None:
            # the holders clearly fastest: TTFT admission decides among them alone,
            # exactly as over the whole fleet, and no window is needed
            admissible = self.admission.decided_by_matches(fleet, request.num_prompt_tokens, request.block_size,
                                                           matches, self._queues.share)
            if admissible is not None:
                return _Candidates(fleet, matches, admissible)
        # weigh the replicas that could hit the prompt and a moving window of the
        # others; the template home and the churn term's mean are still the whole fleet's
        template_home = self._template_home(request, fleet)
        keep: list[str | None] = [*matches, template_home[0], prev.replica_id if prev is not None else None]
        # host-tier runs start past each replica's GPU match (a grouped replica's: its
        # group's length); a replica with one is kept
        runs = index.tier_runs(hashes, matches, groups) if self.config.host_cost < 1.0 else None
        if runs:
            keep.extend(runs)
        if self._pending and hashes:
            first = hashes[0]
            keep.extend(rid for rid, pend in self._pending.items() if first in pend)
        replicas = window.select(fleet, keep, self._routed)
        if groups:
            matches = matches_of_candidates(matches, groups, replicas)
        return _Candidates(replicas, matches, None, template_home, True, runs)

    def _admission(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                   matches: dict[str, int]) -> list[ReplicaLoad]:
        """Stage 2: the replicas whose estimated TTFT is within ``admission_factor`` of the
        best (``TTFTAdmission``), in their order."""
        return self.admission.admissible(replicas, n_tokens, block_size, matches, self._queues.share)

    def _fit(self, admissible: list[ReplicaLoad], n_tokens: int, block_size: int) -> list[ReplicaLoad]:
        """Stage 4 (``fit_first``): of the admissible replicas, those with room for the
        request's blocks (``with_room``), or all of them when none has."""
        return with_room(admissible, n_tokens, block_size)

    def _template_home(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str | None, float]:
        """The template's home (the ring owner of its key block, an offered replica) and
        the blocks credited there; (None, 0.0) without a template."""
        cls = request.cls
        tb = cls.template_blocks
        if not (cls.template and self.config.template_trust and 0 < tb <= len(request.block_hashes)):
            return None, 0.0
        ring = self.ring
        live: set[str] | None = None
        if len(replicas) != len(ring):
            # some replica is not offered (quarantined, excluded) or the ring lacks one (a
            # policy never told of its replicas): the owner must be an offered one
            live = set(map(replica_id_of, replicas))
            for rid in live - ring.members:
                ring.add(rid)
        # else every live replica is offered (``replicas`` is a subset of the ring's
        # members): any member may own, without two sets built per request
        k = min(tb, self.config.template_key_blocks) if self.config.template_key_blocks else tb
        return ring.owner(request.block_hashes[k - 1].hex(), live), self.config.template_trust * tb

    def _score(self, request: RoutingRequest, fleet: Sequence[ReplicaLoad], admissible: list[ReplicaLoad],
               index: LocalityView, cand: _Candidates, prev: _Session | None,
               timed: CostModel | None = None) -> RouteDecision:
        """Stage 5: argmin cost_r over ``admissible`` (the module docstring's formula), ties
        to the less loaded (``load_key``). ``fleet``: every live replica offered (the churn
        term's mean and the template home are the fleet's)."""
        hashes = request.block_hashes
        bs = request.block_size
        n_tokens = request.num_prompt_tokens
        matches = cand.matches
        sticky_id, sticky_blocks = None, 0.0
        if prev is not None and self.config.sticky_trust:
            sticky_id = prev.replica_id
            sticky_blocks = self.config.sticky_trust * common_prefix_blocks(hashes, prev.hashes)
        foot_scale = self.config.footprint_weight * n_tokens if self._footprint else 0.0
        own_id, own_share = (prev.replica_id, self._session_share(prev)) if prev is not None else (None, 0.0)
        template_home = cand.template_home
        home_id, home_blocks = template_home if template_home is not None else self._template_home(request, fleet)
        churn_scale, mean_inflow = 0.0, 0.0
        if self.config.churn_weight and self._inflow:
            # in the totals' raw units: the term reads only inflow / mean
            if len(fleet) == len(self.ring):
                # every live replica (``fleet`` is a subset of them, and only they have
                # inflow): the running total is their sum, without a pass over the fleet
                mean_inflow = self._inflow.total / len(fleet)
            else:  # NOTE: map over C callables: the same sum, in the same order, at C speed
                mean_inflow = sum(map(self._inflow.raw.get, map(replica_id_of, fleet), repeat(0.0))) / len(fleet)
            if mean_inflow > 0:
                churn_scale = self.config.churn_weight * n_tokens

        # NOTE: one pass over the admissible replicas, written for speed (a 1,024-replica
        # fleet runs it per request): locals instead of attributes, ``outstanding`` and
        # ``load_key`` inlined, and the churn / footprint terms skipped where they add
        # exactly 0.0 or where the cost without them already exceeds the best (they are
        # never negative), so the choice is the formula's, bit for bit (the terms' totals
        # as ``DecayingTotals`` holds them).
        pending, share = self._pending, self._queues.share
        inflow, footprint, foot_unit = self._inflow.raw, self._footprint.raw, self._footprint.unit
        evict_weight, rct, load_weight = self.config.evict_weight, self.config.request_cost_tokens, self.config.load_weight
        per_lane = 1.0 / self.admission.prefill_lanes if self.config.queue_per_lane else 0.0
        costs_of = timed.costs if timed is not None else None
        sec = 1.0  # seconds per prefill token on r (priced in tokens: 1)
        host_weight = 1.0 - self.config.host_cost
        # runs through both tiers past each replica's GPU match, for the replicas that have one
        if cand.runs_known:
            runs = cand.runs
        else:
            runs = index.tier_runs(hashes, matches) if self.config.host_cost < 1.0 else None
        best_r: ReplicaLoad | None = None
        best_cost, best_m, best_reason = _INF, 0.0, ""
        n_hashes = len(hashes)
        # the replicas the request could hit (index match, blocks in flight, a host-tier run,
        # the session's sticky replica, the template's home): any other one matches nothing
        # and costs only its load terms (set once here, not tested field by field per replica)
        could_hit = set(matches)
        if pending:
            could_hit.update(pending)
        if runs:
            could_hit.update(runs)
        could_hit.add(sticky_id)
        could_hit.add(home_id)
        for r in admissible:
            rid = r.replica_id
            host = 0.0
            if rid not in could_hit:
                m, reason = 0.0, "load"
            else:
                m_index = matches.get(rid, 0)
                m, reason = float(m_index), ("index_prefix" if m_index else "load")
                pend = pending.get(rid) if pending else None
                if pend:
                    k = m_index
                    while k < n_hashes and hashes[k] in pend:
                        k += 1
                    if k > m:
                        m, reason = float(k), "inflight_prefix"
                if rid == sticky_id and sticky_blocks > m and index.is_stale(rid):
                    m, reason = sticky_blocks, "session_sticky"
                if rid == home_id and home_blocks > m:
                    m, reason = home_blocks, "template_home"
                if runs:
                    run = runs.get(rid)
                    if run is not None and m_index + run.length > m:
                        # the run's blocks past m: GPU ones are full hits, host ones promoted
                        gpu = sum(1 for i in run.gpu_at if i >= m) if run.gpu_at else 0
                        host = m_index + run.length - m - gpu
                        m += gpu
                        if host and reason in ("index_prefix", "load"):
                            reason = "host_prefix"
            qpt = r.queued_prefill_tokens
            q = qpt * share.get(rid, 1.0) if share and qpt else qpt  # the queue's uncached tokens
            if per_lane:
                q *= per_lane
            out = r.running + r.waiting
            if r.in_flight > out:
                out = r.in_flight
            if m or host:
                pressure = 0.0
                if qpt and r.capacity_blocks:
                    pressure = min(1.0, (qpt / bs) / max(1, r.free_blocks))
                hit = bs * (m + host_weight * host) * (1.0 - evict_weight * pressure)
            else:
                hit = 0.0
            if costs_of is None:
                cost = (n_tokens - hit) + load_weight * (q + rct * out)
            else:  # seconds: this backend's prefill of the uncached part, then its drain
                co = costs_of(rid)
                sec = co.prefill_per_token_s
                cost = co.prefill_base_s + sec * (n_tokens - hit) + load_weight * (sec * q + co.per_outstanding_s * out)
            if cost > best_cost:
                continue  # the churn and footprint terms only add: this replica cannot win
            if churn_scale:
                iv = inflow.get(rid)
                if iv is not None and iv > mean_inflow:  # then iv / mean >= 1.0: max(0, .) is a no-op
                    cost += sec * churn_scale * (iv / mean_inflow - 1.0)
            if foot_scale and r.capacity_blocks:
                fv = footprint.get(rid)
                if fv is not None or rid == own_id:
                    foot = (fv * foot_unit if fv is not None else 0.0) - (own_share if rid == own_id else 0.0)
                    if foot > 0.0:  # max(0, foot): a term of 0.0 leaves the cost as it is
                        cost += sec * foot_scale * foot / r.capacity_blocks
            if cost < best_cost or (cost == best_cost and (out, qpt, rid) < load_key(best_r)):
                best_r, best_cost, best_m, best_reason = r, cost, m + host, reason
        assert best_r is not None  # the least-estimate replica is always admissible
        return RouteDecision(best_r.replica_id, best_reason, matched_blocks=int(best_m), score=best_cost)

    def _session_home(self, prev: _Session, hashes: Sequence[BlockHash], admissible: Sequence[ReplicaLoad],
                      index: LocalityView, matches: dict[str, int]) -> RouteDecision | None:
        """The decision that keeps the session on its replica, or None when the replica is
        dead or overloaded (not in ``admissible``) or lost the session's blocks."""
        rid = prev.replica_id
        if not any(r.replica_id == rid for r in admissible):
            return None
        shared = common_prefix_blocks(hashes, prev.hashes)
        if index.is_stale(rid):
            # NOTE: the reason and the credited blocks are the cost path's for a stale view
            # (``sticky_trust`` of the shared prefix), so metrics read the same either way.
            return RouteDecision(rid, "session_sticky", matched_blocks=int(self.config.sticky_trust * shared))
        m = matches.get(rid, 0)
        if m >= max(1.0, self.config.session_hold_frac * shared):
            prev.confirmed = True
        elif prev.confirmed:
            return None  # the index showed the session here and no longer does: evicted
        return RouteDecision(rid, "session_home", matched_blocks=m)

    # -- lifecycle ------------------------------------------------------------------

    def _session_share(self, s: _Session) -> float:
        """What session ``s`` still adds to its replica's footprint (its turn's prompt
        blocks, decayed since it was routed)."""
        return len(s.hashes) * self._foot_decay ** (self._routed - s.routed_at)

    def _drop_footprint(self, s: _Session) -> float:
        """Take session ``s``'s share out of its replica's footprint (never below 0);
        returns the share."""
        share = self._session_share(s)
        self._footprint.subtract(s.replica_id, share)
        return share

    def on_request_routed(self, request: RoutingRequest, decision: RouteDecision) -> None:
        rid = decision.replica_id
        cls = request.cls
        self._routed += 1
        self._footprint.decay(self._foot_decay)
        prev_rid, prev_share, blocks = "", 0.0, 0
        if cls.session_id is not None:
            key = session_key(cls.tenant, cls.session_id)
            prev = self._sessions.pop(key, None)
            confirmed = False
            if prev is not None:
                prev_rid, prev_share = prev.replica_id, self._forget_session(prev)
                confirmed = prev.confirmed and prev.replica_id == rid
            blocks = len(request.block_hashes)
            self._remember_session(key, _Session(rid, request.block_hashes, self._routed, confirmed))
        inflow = self._inflow
        inflow.decay(self._decay)
        new_tokens = uncached_tokens(request, decision)
        inflow.add(rid, new_tokens)
        if self._outbox is not None:
            self._outbox.append(RoutedEvent(rid, new_tokens, blocks, prev_rid, prev_share))
        if self.config.queue_share:
            self._queues.add(request.request_id, rid, new_tokens, request.num_prompt_tokens)
        if not self.config.track_inflight:
            return
        self._release(request.request_id)
        self._inflight[request.request_id] = _InFlight(rid, request.block_hashes)
        pend = self._pending.setdefault(rid, {})
        for bh in request.block_hashes:
            pend[bh] = pend.get(bh, 0) + 1
        while len(self._inflight) > self.config.max_inflight:
            self._release(next(iter(self._inflight)))

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None:
        self._queues.remove(request.request_id)

    def on_request_finished(self, request: RoutingRequest, replica_id: str) -> None:
        self._queues.remove(request.request_id)
        self._release(request.request_id)

    def export_session(self, key: str) -> SessionRecord | None:
        s = self._sessions.get(key)
        return SessionRecord(s.replica_id, s.hashes, s.confirmed, s.routed_at) if s is not None else None

    def import_session(self, key: str, record: SessionRecord) -> None:
        """The record replaces this policy's memory of the session. Alone, as if this
        router had routed that turn just now (its footprint share moves with it); sharing
        terms, at the record's clock and without touching the footprint, which the routers'
        events already carry (the turn's router added it)."""
        sessions = self._sessions
        alone = self._outbox is None
        prev = sessions.pop(key, None)
        if prev is not None:
            if (prev.replica_id, prev.hashes, prev.confirmed) == (record.replica_id, record.hashes, record.confirmed):
                sessions[key] = prev  # this router wrote it: keep its age
                return
            self._forget_session(prev, footprint=alone)
        at = self._routed
        if not alone and record.routed_at is not None:
            at = min(record.routed_at, at)
        self._remember_session(key, _Session(record.replica_id, record.hashes, at, record.confirmed), footprint=alone)

    # -- terms shared between routers -----------------------------------------------

    def share_terms(self) -> bool:
        """From now on the session footprint changes only through routed events (this
        router's and the others', ``apply_routed``): the session table is this router's
        memory of where sessions went, and remembering or forgetting a session there no
        longer moves the footprint."""
        if self._outbox is None:
            self._outbox = []
        self._queues.track_changes()  # the exchange takes the changed sums every round
        return True

    def take_routed(self) -> list[RoutedEvent]:
        out = self._outbox or []
        if self._outbox:
            self._outbox = []
        return out

    def apply_routed(self, events: Sequence[RoutedEvent]) -> None:
        """``on_request_routed``'s effect on the decays' clock, the churn inflow and the
        footprint, for each event in order (the session table is left alone: the turn's
        record reaches this router through the session store).

        NOTE: the terms decay by the batch's length at once (one multiplication:
        ``DecayingTotals``) and each event's contribution by the steps after it, which is
        the sequential result (bit for bit for a batch of one) but for rounding and where
        a footprint subtraction would have been clamped at 0 part-way."""
        m = len(events)
        if not m:
            return
        fp, fdecay, inflow, decay = self._footprint, self._foot_decay, self._inflow, self._decay
        self._routed += m
        fp.decay(fdecay ** m)
        inflow.decay(decay ** m)
        for j, ev in enumerate(events):
            after = m - 1 - j  # decay steps that follow this event in the batch
            fw = fdecay ** after if after else 1.0
            rid = ev.replica_id
            fp.subtract(ev.prev_replica_id, ev.prev_share * fw)
            if ev.session_blocks:
                fp.add(rid, ev.session_blocks * fw)
            inflow.add(rid, ev.new_tokens * (decay ** after if after else 1.0))

    def _remember_session(self, key: str, s: _Session, footprint: bool = True) -> None:
        """Store ``s`` as session ``key``'s latest turn (not present), add its footprint
        (``footprint``), and drop the oldest sessions while over a bound (their footprint
        taken out unless sharing terms: see ``share_terms``)."""
        sessions = self._sessions
        sessions[key] = s
        self.session_blocks += len(s.hashes)
        if footprint:
            self._footprint.add(s.replica_id, len(s.hashes))
        alone = self._outbox is None
        while len(sessions) > self.config.max_sessions or (self.session_blocks > self.config.max_session_blocks and len(sessions) > 1):
            self._forget_session(sessions.popitem(last=False)[1], footprint=alone)

    def _forget_session(self, s: _Session, footprint: bool = True) -> float:
        """Account for ``s`` having left ``_sessions``; with ``footprint``, take its share
        out of the footprint and return it (else 0)."""
        share = self._drop_footprint(s) if footprint else 0.0
        self.session_blocks -= len(s.hashes)
        return share

    def queued_tokens(self) -> dict[str, tuple[int, int]]:
        return self._queues.own_sums()

    def take_queued_changes(self) -> dict[str, tuple[int, int]]:
        return self._queues.take_changes()

    def queue_shares(self) -> dict[str, float] | None:
        return dict(self._queues.share) if self.config.queue_share else None

    def set_peer_queued(self, totals: dict[str, tuple[int, int]]) -> None:
        if self.config.queue_share:
            self._queues.set_peer(totals)

    def _release(self, request_id: str) -> None:
        fl = self._inflight.pop(request_id, None)
        if fl is None:
            return
        pend = self._pending.get(fl.replica_id)
        if pend is None:
            return
        for bh in fl.hashes:
            c = pend.get(bh, 0) - 1
            if c > 0:
                pend[bh] = c
            else:
                pend.pop(bh, None)

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        live = set(replica_ids)
        # NOTE: the churn term compares each replica's inflow with the mean; a window of
        # fewer requests than several per replica leaves most replicas at 0 and makes
        # any recent one look many times the mean (see CHURN_WINDOW_PER_REPLICA).
        self._decay = 1.0 - 1.0 / max(self.config.churn_window, CHURN_WINDOW_PER_REPLICA * len(live))
        known = set(self._pending) | set(self._inflow) | set(self._footprint) | set(self.ring.members)
        known |= self._queues.replicas()
        known |= {f.replica_id for f in self._inflight.values()}
        for rid in known - live:
            self.on_replica_died(rid)
        self.ring.set_members(live)  # NOTE: one rebuild, not one per replica

    def on_replica_died(self, replica_id: str) -> None:
        self._pending.pop(replica_id, None)
        self._queues.drop_replica(replica_id)
        self._inflow.pop(replica_id, None)
        self._footprint.pop(replica_id, None)
        self.ring.remove(replica_id)
        for rid in [k for k, f in self._inflight.items() if f.replica_id == replica_id]:
            del self._inflight[rid]
        for key in [k for k, s in self._sessions.items() if s.replica_id == replica_id]:
            self._forget_session(self._sessions.pop(key))
