"""``cache_aware`` (ours): minimise an estimate of each replica's time to first token,
while keeping the replicas' cache churn even.

For a request of N prompt tokens and chained block hashes h[0..L), block size B, and
every live replica r:

    m_r      = blocks of h the replica holds or will hold:
                 index    = LocalityView.prefix_matches(h)[r]  (published holdings)
                 inflight = index extended while h[i] is in a prompt routed to r and not
                            finished yet (being computed: it will be cached; only with
                            ``track_inflight``)
                 sticky   = sticky_trust * k on the session's last replica, k = common
                            prefix with the session's previous turn, only while the view
                            is stale for r (``LocalityView.is_stale``: Redis down, resync)
                 home     = template_trust * template_blocks on the template's home, the
                            owner of h[k - 1], k = min(template_blocks,
                            template_key_blocks), on a consistent-hash ring
               m_r = max(inflight, sticky, home)
    p_r      = min(1, (queued_prefill_tokens_r / B) / max(1, free_blocks_r))
               (eviction pressure: the share of r's evictable blocks that work already
               queued there claims before this request is admitted)
    run_r    = the run that continues the index match through both tiers
               (``LocalityView.tier_runs(h, index matches)[r]``: its first block on the
               host, later ones on the host or the GPU, as the replica's store matches)
    g_r, h_r = of run_r's blocks past m_r, those on the GPU (shared, full hits) and those
               on the host (the replica would promote them, copying their KV from host
               memory)
    hit_r    = B * (m_r + g_r + (1 - host_cost) * h_r) * (1 - evict_weight * p_r)
               (a matched block likely to be evicted before use counts less; a host block
               saves its prefill but costs its copy, host_cost of a prefill per token)
    load_r   = q_r * queued_prefill_tokens_r / L + request_cost_tokens * outstanding_r
               (L = prefill_lanes with ``queue_per_lane``, else 1: the queue drains on every
               lane while the request's own prefill runs on one, as the admission estimate
               below counts it)
    q_r      = the uncached share of r's queue (``queue_share``): of the router's requests
               (sharing terms: every router's) routed to r that have not sent their
               first token, the uncached prompt
               tokens at routing (N - B * matched blocks of the decision) over their whole
               prompt tokens; 1 when there are none (replicas publish their queue as whole
               prompts: an engine learns a request's match only when it schedules it)
    churn_r  = N * max(0, inflow_r / mean(inflow) - 1), inflow_r = the uncached prompt
               tokens routed to r, decayed by (1 - 1/W) per routed request,
               W = max(churn_window, 32 x live replicas)
               (new blocks per replica: what evicts cached blocks there, and the prefill
               work the load-imbalance figure counts)
    foot_r   = N * F_r / capacity_blocks_r, F_r = the prompt blocks of each session's
               latest turn routed to r, decayed by (1 - 1/footprint_window) per routed
               request, leaving out the request's own session (the share of r's cache
               that live sessions will read again soon: a request placed there competes
               with them for it; 0 when the capacity is unknown)
    cost_r   = (N - hit_r) + load_weight * load_r + churn_weight * churn_r
               + footprint_weight * foot_r

Explicit sessions first: a request whose session has a remembered previous turn goes to
that turn's replica (reason ``session_home``) unless the replica is dead (not among the
live replicas), not admissible under the TTFT admission rule below (a long prefill queue, or
another replica holding so much more of the prompt that it is over twice as fast), or no longer
holds the session's blocks (reason ``session_sticky`` while the view is stale for it): the view is fresh for it, it once showed at least
``session_hold_frac`` of the session's prefix there (the session is *confirmed*), and now
shows less. An unconfirmed session stays home on a miss, because a fresh-looking index
can lag the replica by one event flush: the previous turn's blocks may simply not be
published yet (live, that lag moved later turns of sequential sessions before). Otherwise
(``session_sticky`` off, or one of the three exceptions) the cost below decides.

The request goes to argmin cost_r over the *admissible* replicas, those whose estimated
TTFT is within ``admission_factor`` of the best replica's
(``unicache.router.routing.admission``: est_r = uncached prompt tokens by the index +
q_r * queued_prefill_tokens_r / prefill_lanes; a hard guard so locality never makes a request
wait longer than recomputing its prefix elsewhere) and, with ``fit_first``, of those the
ones with room for the request's blocks (``with_room``: free_blocks_r -
queued_prefill_tokens_r / B >= ceil(N / B)), when any has; ties go to the less loaded
replica (``load_key``). KV memory, not prefill, is what fills first on every family of the
routing suite, and a replica without free blocks makes a request wait for running ones to
finish: on the suite's 26 tuning traces fit-first raised goodput 1.031x at 4 replicas and
1.036x at 8 over the same policy without it, token hits -0.06 / -0.04 points
(the ``kv_admission`` study, docs/studies.md); applied to a session's home too it cost agent traffic
0.974x / 0.929x (a moved turn recomputes its context), so a home is judged before it.
The queue share (q_r) exists because replicas publish whole prompts (of the requests
without a first token, waiting or being prefilled: what the vLLM engine can see): on agent
traffic, mostly cached, that overstated the work at the replica holding a session's or an
agent prompt's context several times, so under load turns and first turns left it and
copied their context elsewhere; on the 26 tuning traces it raised goodput 1.014x at 4
replicas (agent 1.099x) and 1.023x at 8 over whole prompts, as much as an oracle of each
queue's uncached tokens (the ``queue_share`` study, docs/studies.md; measured while the simulator
published waiting requests only). The queue counts over the prefill lanes in the cost
(``queue_per_lane``) since the simulator publishes running prefills as the engines do: a
running prefill holds one lane of several, and weighed 1:1 against the request's own
uncached tokens it drove requests off the replicas holding their prefixes (26 tuning traces:
the policy with the whole queue in its cost scored 1.054x / 1.045x at 4 / 8 replicas fed
the old figure than fed the engines'; counting the queue per lane scores 1.019x / 1.016x
the whole queue, a third of that back, the ``prefill_queue`` study, docs/studies.md).
The load weight stays 1.0: cross-validation with 0.5 among the candidates picked 0.5 by
about 1% of mean log goodput, but on tuning points no default was chosen on 0.5 scored
0.949x (95% interval 0.845-1.019) and 1.009x (0.990-1.028) at 4 / 8 replicas, neither
interval above 1.0 as the rule fixed before the run required (the ``load_weight`` study, docs/studies.md).
On those points the admission factor 1.5 scored 1.022x (1.000-1.052) at 4 replicas and
0.971x (0.921-1.013) at 8, so 2.0 stays by the same rule; the footprint term and the queue
per lane held there (the ``fresh_points`` study, docs/studies.md).
Defaults: load_weight 1.0, request_cost_tokens 128,
evict_weight 0.5, host_cost 0.08, sticky_trust 0.5, template_trust 0.1, churn_weight 0.5,
churn_window 256, footprint_weight 0.5, footprint_window 96, track_inflight off,
admission_factor 2.0, prefill_lanes 4, template_key_blocks 1, session_sticky on,
session_hold_frac 0.5, fit_first on, queue_share on, queue_per_lane on. TTFT admission replaced a fixed balance guard (outstanding within
1.5 x the mean): on 26 suite tuning traces it raised goodput against sglang + unicache
from 1.098x to 1.143x at 4 replicas and from 1.189x to 1.299x at 8, and token hits
against sglang + unicache from -0.70 to +0.21 points at 4 and from -2.09 to +0.09 at 8;
max load imbalance rose from 1.63 to 2.02 at 8 (the ``routing_admission`` study, docs/studies.md). The
admission factor 2.0 comes from that study (3.0 ties it there: 1.138x and 1.298x) and is
``bench.routing_report``'s leave-one-family-out pick of goodput over the suite's 25 tuning
traces (with the queue per lane: mean log goodput -0.170, against -0.190 for 1.5 and
-0.193 for 3.0; 7 of 7 held-out families pick it). The queue per lane (7 of 7 held-out
families; -0.170 against -0.190 without) and the footprint term at 0.5 (4 of 7; the other
3 pick 0.0, all-family -0.170 against -0.175) were chosen by that cross-validation, and
the churn term at 0.5, fit-first on and the queue share on by its earlier form over 48
settings on 7 tuning traces (7, 6 and 7 of 7 held-out families); the other terms by replaying three seeds of the default mix and the Mooncake
trace at 4 replicas (the ``routing_mix`` study, docs/studies.md, with an ablation of each term); the
footprint window by seeds 0-8 of the mix, checked on seeds 9-17
(the ``routing_footprint`` study, docs/studies.md).

In a fleet of more than ``candidate_window`` replicas (default 32), unless TTFT admission
can decide among the replicas holding the prompt alone (then exactly as over the whole
fleet), the replicas weighed (admission, fit-first, cost) are the candidates of
``unicache.router.routing.candidates``: those that could hit the prompt (the index's
holders of its first block, host-tier runs, blocks in flight, the session's replica, the
template's home), the fleet's least-queued replica, and a window of 32 others that moves
by its size with each routed request; the churn term's mean and the template home stay
the whole fleet's. A prefix more than half the fleet holds (a system prompt everywhere)
sets no replica apart: ``LocalityView.prefix_match_groups`` groups its holders by length
and they are weighed only where the window brings them in (``matches_of_candidates``).
A prompt no replica holds, or one most of them hold, then costs a decision about what it
costs in a fleet of 32 instead of growing with the fleet (``bench.fleet_scale``). The
window's size is the smallest of 32, 64 and 128 that held TTFT mean and p99 within 1.05x
and token hits within 0.5 points of weighing every replica over six tuning workloads at
256 and 1,024 replicas, a rule fixed before the run (the ``candidate_window`` study, docs/studies.md:
0.982x / 0.992x, -0.04 points). Fleets up to the window decide exactly as without it:
every figure at 4 and 8 replicas is unchanged.

There is no balance rule beyond TTFT admission, though load imbalance (max / mean
computed prefill tokens per replica) runs above 1.2: every bound measured lost goodput
(the ``routing_balance`` study, docs/studies.md, the admission study's 26 tuning traces). Bounding each
replica's decayed computed tokens (the churn term's inflow, plus the request's uncached
tokens there) at 1.2 x the mean after placement, for requests without a kept session
home, cut max imbalance from 1.63 to 1.22 at 4 replicas and from 2.02 to 1.54 at 8
(traces within 1.2: 19 -> 24 and 10 -> 19 of 26), for goodput against sglang + unicache
1.143x -> 1.127x and 1.299x -> 1.286x and token hits +0.21 -> -0.20 and +0.09 -> -0.63
points; applied to session turns too (a session leaves a home that ran ahead), 1.18 and
1.48 for 1.116x and 1.135x. Where one explicit session computes more than 1.2 x a
replica's mean share, no placement that keeps sessions home reaches 1.2 (the study's
session-atomic bound: 1.86 and 1.40 on two chat report traces at 8 replicas).

The footprint term is what the churn term cannot see: churn is a flow (new blocks per
request), a live session's context is a stock that stays cached between its turns. Long
agent sessions grow to most of one replica's cache; without the term, unrelated work
keeps landing beside them and the two evict each other.

Task and template locality come mostly from chained hashes: requests of one template
(or one agent system prompt) share leading hashes, so ``m_r`` steers them to where those
blocks live, and the churn term spreads *new* prefixes instead of piling them on the
replica that happens to hold a tenant's short system prompt. ``inflight`` and ``home``
cover what the index cannot know yet (a burst of one new template before its blocks are
published); the sticky floor keeps sessions in place while the index is unavailable.
The home is keyed on the template's first ``template_key_blocks`` blocks, not on its
last block: a template's known extent (``template_blocks``, from the classifier's
popularity counts) grows as it warms, and a key on its last block moved the home each
time, scattering the template's copies (mean of mix seeds 0-5, 4 replicas x 1%: 47.5%
token hits keyed on the last block, 47.9 without homes, 48.3 keyed on the first block).
Where every template shares a first block (a common system prompt), raise it.

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

from unicache.block_hash import BlockHash
from unicache.router.routing.admission import TTFTAdmission
from unicache.router.routing.base import (
    LocalityView, ReplicaLoad, RouteDecision, RoutedEvent, RoutingPolicy, RoutingRequest, SessionRecord, replica_id_of,
)
from unicache.router.routing.candidates import CandidateWindow
from unicache.router.routing.decaying import DecayingTotals
from unicache.router.routing.keys import HashRing, load_key, session_key
from unicache.router.routing.queue_share import QueueShares
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
# at. With a fixed 256 at 1,024 replicas most replicas had no inflow in the window, and
# one that had just taken a new prompt stood at hundreds of times the mean, so the churn
# term outweighed any prefix hit there: on Mooncake at 1,024 replicas TTFT p99 9.39 s and
# imbalance 4.49 with the fixed window, 5.64 s and 2.22 with this one; on a generated mix
# within 3% (the ``churn_window_fleet`` study, docs/studies.md).
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


@register_routing_policy("cache_aware")
class CacheAwarePolicy(RoutingPolicy):
    """Prefix locality against load and churn, with stickiness, template homes and
    eviction risk. The formula and its defaults are in the module docstring. Implements
    ``SharesRouterState``: several routers share its sessions and traffic-derived terms.

    Args:
        load_weight: tokens of cost per token of work queued ahead (default 1.0).
        request_cost_tokens: work, in prompt tokens, one outstanding request stands for
            (default 128).
        evict_weight: how much full eviction pressure discounts a matched block (0.5).
        host_cost: a promoted token's cost in prefilled tokens: H2D copy time per token
            over prefill time per token (default 0.08: 128 KiB of KV per token at 25 GB/s
            is 5.2 us, against 68 us per token of the simulator's prefill fit at 512
            tokens; ``unicache.sim.timing``). 1 ignores host tiers.
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
        track_inflight: count blocks of unfinished requests as held (default False: on
            the suite's tuning traces it scored 0.991x / 0.992x the goodput without it at
            4 / 8 replicas with the index lagging 50 ms as live, 0.994x / 0.986x with a
            fresh one: the ``index_lag`` study, docs/studies.md).
        admission_factor: a replica is admissible while its estimated TTFT is at most
            this times the best replica's (default 2.0; ``TTFTAdmission``).
        prefill_lanes: what a replica's queue is divided by in the TTFT estimate and the
            load term (default 4, the simulator's prefill lanes). An engine that steps
            (vLLM, the built-in one) drains its queue at the speed of one request's
            prefill, which suggests 1, but on the step service model 4 still scores best:
            1 lane 0.986x / 0.932x its goodput at 4 / 8 replicas on the tuning traces, 2
            lanes 0.985x / 0.988x, 4 every held-out family's pick
            (the ``step_lanes`` study, docs/studies.md): KV memory, not prefill, binds there.
        session_sticky: a session's next turn goes to its previous turn's replica unless
            that replica is dead, not admissible or lost the session's blocks (default
            True; False leaves sessions to the cost, as before).
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
        virtual_nodes: points per replica on the template ring (default 160).
        template_key_blocks: the home is the ring owner of the hash of block
            min(template_blocks, template_key_blocks) - 1 (default 1: the first block, a
            key that stays put while the template's known extent grows; 0: the template's
            last block).
        candidate_window: in a fleet of more than this many replicas, a decision weighs
            the replicas that could hit the prompt and this many others, a window that
            moves with each routed request (``unicache.router.routing.candidates``;
            default 32; 0: every replica). Fleets up to it decide as without it.
        max_sessions / max_inflight: bounds on router-side state.
        max_session_blocks: bound on the prompt hashes the remembered sessions hold in all
            (default 4,000,000; the router derives it from its memory budget,
            ``unicache.router.memory``).
    """

    def __init__(
        self,
        load_weight: float = 1.0,
        request_cost_tokens: float = 128.0,
        evict_weight: float = 0.5,
        host_cost: float = 0.08,
        sticky_trust: float = 0.5,
        template_trust: float = 0.1,
        churn_weight: float = 0.5,
        churn_window: int = 256,
        footprint_weight: float = 0.5,
        footprint_window: int = 96,
        track_inflight: bool = False,
        admission_factor: float = 2.0,
        prefill_lanes: int = 4,
        session_sticky: bool = True,
        session_hold_frac: float = 0.5,
        fit_first: bool = True,
        queue_share: bool = True,
        queue_per_lane: bool = True,
        virtual_nodes: int = 160,
        template_key_blocks: int = 1,
        max_sessions: int = 100_000,
        max_inflight: int = 100_000,
        max_session_blocks: int = 4_000_000,
        candidate_window: int = 32,
    ):
        if churn_window <= 0 or footprint_window <= 0:
            raise ValueError("churn_window and footprint_window must be positive")
        if template_key_blocks < 0:
            raise ValueError("template_key_blocks must be >= 0")
        if not 0.0 <= session_hold_frac <= 1.0:
            raise ValueError("session_hold_frac must be in [0, 1]")
        self.session_sticky = session_sticky
        self.session_hold_frac = session_hold_frac
        self.fit_first = fit_first
        self.queue_share = queue_share
        self.queue_per_lane = queue_per_lane
        self.load_weight = load_weight
        self.request_cost_tokens = request_cost_tokens
        self.evict_weight = evict_weight
        if not 0.0 <= host_cost <= 1.0:
            raise ValueError("host_cost must be in [0, 1]")
        self.host_cost = host_cost
        self.sticky_trust = sticky_trust
        self.template_trust = template_trust
        self.churn_weight = churn_weight
        self.track_inflight = track_inflight
        self.admission = TTFTAdmission(admission_factor, prefill_lanes)
        self.max_sessions = max_sessions
        self.max_inflight = max_inflight
        self.max_session_blocks = max_session_blocks
        self.session_blocks = 0  # hashes held by the remembered sessions
        self.ring = HashRing(virtual_nodes)
        self.template_key_blocks = template_key_blocks
        self.churn_window = churn_window
        self._decay = 1.0 - 1.0 / churn_window
        self._inflow = DecayingTotals()
        self.footprint_weight = footprint_weight
        self.footprint_window = footprint_window
        self._foot_decay = 1.0 - 1.0 / footprint_window
        self._footprint = DecayingTotals()
        self._routed = 0  # requests routed so far (by every router, when sharing terms): the decays' clock
        self._outbox: list[RoutedEvent] | None = None  # this router's events, when sharing terms
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._inflight: OrderedDict[str, _InFlight] = OrderedDict()
        self._pending: dict[str, dict[BlockHash, int]] = {}
        self._queues = QueueShares(max_inflight)
        self._window = CandidateWindow(candidate_window)

    # -- decision -------------------------------------------------------------------

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        return self.admission.admissible(replicas, n_tokens, block_size, matches, self._queues.share)

    def _with_room(self, admissible: list[ReplicaLoad], n_tokens: int, block_size: int) -> list[ReplicaLoad]:
        """Fit-first's filter (``with_room``)."""
        return with_room(admissible, n_tokens, block_size)

    def _template_home(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str | None, float]:
        cls = request.cls
        tb = cls.template_blocks
        if not (cls.template and self.template_trust and 0 < tb <= len(request.block_hashes)):
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
        k = min(tb, self.template_key_blocks) if self.template_key_blocks else tb
        return ring.owner(request.block_hashes[k - 1].hex(), live), self.template_trust * tb

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        hashes = request.block_hashes
        bs = request.block_size
        n_tokens = request.num_prompt_tokens
        cls = request.cls

        prev = self._sessions.get(session_key(cls.tenant, cls.session_id)) if cls.session_id is not None else None
        fleet = replicas
        template_home: tuple[str | None, float] | None = None
        runs_known, runs = False, None
        window = self._window
        admissible: list[ReplicaLoad] | None = None
        if not window.applies(len(fleet)):
            matches = index.prefix_matches(hashes)  # NOTE: one walk; replicas left out match 0
        else:
            # a large fleet. A prefix more than half the fleet holds (a system prompt
            # everywhere) sets no replica apart: its holders come grouped by length, and
            # count only where the window below or another reason brings them in
            matches, groups = index.prefix_match_groups(hashes, len(fleet) // 2)
            if not groups:
                # the holders clearly fastest: TTFT admission decides among them alone,
                # exactly as over the whole fleet, and no window is needed
                admissible = self.admission.decided_by_matches(fleet, n_tokens, bs, matches, self._queues.share)
            if admissible is None:
                # weigh the replicas that could hit the prompt and a moving window of the
                # others (``candidates``); the template home and the churn term's mean
                # are still the whole fleet's
                template_home = self._template_home(request, fleet)
                keep: list[str | None] = [*matches, template_home[0], prev.replica_id if prev is not None else None]
                # host-tier runs start past each replica's GPU match (a grouped replica's:
                # its group's length); a replica with one is kept
                runs_known, runs = True, (index.tier_runs(hashes, matches, groups) if self.host_cost < 1.0 else None)
                if runs:
                    keep.extend(runs)
                if self._pending and hashes:
                    first = hashes[0]
                    keep.extend(rid for rid, pend in self._pending.items() if first in pend)
                replicas = window.select(fleet, keep, self._routed)
                if groups:
                    matches = matches_of_candidates(matches, groups, replicas)
        if admissible is None:
            admissible = self._admissible(replicas, n_tokens, bs, matches)
        if prev is not None and self.session_sticky:
            kept = self._session_home(prev, hashes, admissible, index, matches)
            if kept is not None:
                return kept
        if self.fit_first:
            admissible = self._with_room(admissible, n_tokens, bs)
        sticky_id, sticky_blocks = None, 0.0
        if prev is not None and self.sticky_trust:
            sticky_id = prev.replica_id
            sticky_blocks = self.sticky_trust * common_prefix_blocks(hashes, prev.hashes)
        foot_scale = self.footprint_weight * n_tokens if self._footprint else 0.0
        own_id, own_share = (prev.replica_id, self._session_share(prev)) if prev is not None else (None, 0.0)
        home_id, home_blocks = template_home if template_home is not None else self._template_home(request, fleet)
        churn_scale, mean_inflow = 0.0, 0.0
        if self.churn_weight and self._inflow:
            # in the totals' raw units: the term reads only inflow / mean
            if len(fleet) == len(self.ring):
                # every live replica (``fleet`` is a subset of them, and only they have
                # inflow): the running total is their sum, without a pass over the fleet
                mean_inflow = self._inflow.total / len(fleet)
            else:  # NOTE: map over C callables: the same sum, in the same order, at C speed
                mean_inflow = sum(map(self._inflow.raw.get, map(replica_id_of, fleet), repeat(0.0))) / len(fleet)
            if mean_inflow > 0:
                churn_scale = self.churn_weight * n_tokens

        # NOTE: one pass over the admissible replicas, written for speed (a 1,024-replica
        # fleet runs it per request): locals instead of attributes, ``outstanding`` and
        # ``load_key`` inlined, and the churn / footprint terms skipped where they add
        # exactly 0.0 or where the cost without them already exceeds the best (they are
        # never negative), so the choice is the formula's, bit for bit (the terms' totals
        # as ``DecayingTotals`` holds them).
        pending, share = self._pending, self._queues.share
        inflow, footprint, foot_unit = self._inflow.raw, self._footprint.raw, self._footprint.unit
        evict_weight, rct, load_weight = self.evict_weight, self.request_cost_tokens, self.load_weight
        per_lane = 1.0 / self.admission.prefill_lanes if self.queue_per_lane else 0.0
        host_weight = 1.0 - self.host_cost
        # runs through both tiers past each replica's GPU match, for the replicas that have one
        if not runs_known:
            runs = index.tier_runs(hashes, matches) if self.host_cost < 1.0 else None
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
                cost = (n_tokens - hit) + load_weight * (q + rct * out)
            else:
                cost = n_tokens + load_weight * (q + rct * out)
            if cost > best_cost:
                continue  # the churn and footprint terms only add: this replica cannot win
            if churn_scale:
                iv = inflow.get(rid)
                if iv is not None and iv > mean_inflow:  # then iv / mean >= 1.0: max(0, .) is a no-op
                    cost += churn_scale * (iv / mean_inflow - 1.0)
            if foot_scale and r.capacity_blocks:
                fv = footprint.get(rid)
                if fv is not None or rid == own_id:
                    foot = (fv * foot_unit if fv is not None else 0.0) - (own_share if rid == own_id else 0.0)
                    if foot > 0.0:  # max(0, foot): a term of 0.0 leaves the cost as it is
                        cost += foot_scale * foot / r.capacity_blocks
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
            return RouteDecision(rid, "session_sticky", matched_blocks=int(self.sticky_trust * shared))
        m = matches.get(rid, 0)
        if m >= max(1.0, self.session_hold_frac * shared):
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
        new_tokens = max(0, request.num_prompt_tokens - decision.matched_blocks * request.block_size)
        inflow.add(rid, new_tokens)
        if self._outbox is not None:
            self._outbox.append(RoutedEvent(rid, new_tokens, blocks, prev_rid, prev_share))
        if self.queue_share:
            self._queues.add(request.request_id, rid, new_tokens, request.num_prompt_tokens)
        if not self.track_inflight:
            return
        self._release(request.request_id)
        self._inflight[request.request_id] = _InFlight(rid, request.block_hashes)
        pend = self._pending.setdefault(rid, {})
        for bh in request.block_hashes:
            pend[bh] = pend.get(bh, 0) + 1
        while len(self._inflight) > self.max_inflight:
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
        while len(sessions) > self.max_sessions or (self.session_blocks > self.max_session_blocks and len(sessions) > 1):
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
        return dict(self._queues.share) if self.queue_share else None

    def set_peer_queued(self, totals: dict[str, tuple[int, int]]) -> None:
        if self.queue_share:
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
        self._decay = 1.0 - 1.0 / max(self.churn_window, CHURN_WINDOW_PER_REPLICA * len(live))
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
