"""TTFT admission: which replicas may take a request, judged by its estimated time to first token.

A cache-aware policy wants the replica that holds the request's prefix, but a replica
whose prefill queue is long makes the request wait longer than recomputing the prefix
elsewhere would. A fixed balance rule (outstanding requests within a ratio of the mean)
guards against piling up, but it counts decoding requests, which do not delay a prefill,
and it ignores what the cached prefix saves. This module compares the two things that
make up the wait instead, in prefill tokens (prefill time is close to linear in the
tokens computed):

    est_r = uncached_r + queued_prefill_tokens_r / prefill_lanes
    uncached_r = max(0, N - B * m_r)       m_r: leading blocks the index shows on r

(``queued_prefill_tokens`` is prompt work admitted and not computed yet, whole prompts as
replicas publish it; a caller that knows what share of it is uncached passes that share,
``queue_share[r]``, and the queue counts ``queued_prefill_tokens_r * queue_share[r]``;
a replica runs ``prefill_lanes`` prefill batches at once.) A replica is *admissible* when

    est_r <= factor * min_r' est_r'   and it is not saturated:   sat_r <= factor * min_r' sat_r' + wait_cost

    sat_r = est_r + wait_cost * unstarted_r,   unstarted_r = max(0, outstanding_r - running_r)

so the cache-best replica keeps the request unless its queueing delay makes the
estimated TTFT more than ``factor`` times the best alternative's. The least-estimate
replica is always admissible, so the set is never empty: when every replica the first
rule admits is saturated, the admissible set is the replicas within ``factor`` of the
least ``sat`` (``sat_r <= factor * min sat + wait_cost``), which holds that least one.
The ``+ wait_cost`` tolerates one unstarted request beyond the factor: with short prompts
(estimates of a few dozen tokens) a single request in transit, or another router's in-flight
count not yet updated, would otherwise take a session's home out of admission.

Saturation is what lets a hot spot overflow. ``unstarted_r`` counts the requests at r it
has not started: waiting for a slot there, or sent by the router and not reported
running yet (``ReplicaLoad.outstanding`` less ``running``); each stands for ``wait_cost``
prefill tokens of delay (``CacheAwarePolicy``: its ``request_cost_tokens``), whatever
its prompt: a request queued behind a full replica waits for running ones to finish,
which a cached prompt does not shorten. Without it, a replica that holds a long prefix
or a session estimates near 0, and while its queue is that same cached traffic the
queue's uncached share keeps the queue term near 0 too: no other replica is ever within
``factor`` of it, however many requests pile up there (issue 39: 583 of 583 requests
on one replica). Saturation only takes replicas out: decoding requests do not count, a
replica with no unstarted request is never saturated (``sat = est``), and while no
replica has one the set is the first rule's alone. ``wait_cost`` 0 turns it off.

A replica the index shows nothing of estimates at least N (its queue only adds), so when
the best replica that matches estimates below N / factor, no other one can be admissible
nor the best: the set is then found among the matching replicas alone, without
estimating the rest of the fleet (``admissible``: the same set, in the same order, as the
full pass; at 1,024 replicas the full pass cost about 0.25 ms of a 0.47 ms decision).

Invariants:
    * ``admissible`` keeps the input order and is never empty for a non-empty input.
    * The estimate depends only on the request's length, the index's match, the
      replica's published load and the caller's queue share (the live router and the
      simulator see the same inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from unicache.router.routing.base import ReplicaLoad, replica_id_of
from unicache.router.routing.cost_model import Costs


# The matching replicas are tried first in fleets of at least this many replicas, when at
# most 1 / MATCHES_FIRST_MAX_SHARE of them match (below, the full pass costs about as much;
# above, as when every replica holds a shared system prompt's first block, trying them
# first is a second full pass whenever it cannot decide).
MATCHES_FIRST_MIN_REPLICAS = 32
MATCHES_FIRST_MAX_SHARE = 4


class ReplicaPositions:
    """Where each replica id sits in the replicas sequence a policy is handed: O(1) per id
    while the fleet's membership and order stay as they were (the live router and the
    simulator pass the same ids in the same order request after request), rebuilt (one
    pass at C speed) when an id is not where the map says.

    Invariant: ``find`` returns i only if ``replicas[i].replica_id == rid``, and None only
    if no element of ``replicas`` has that id (the map was rebuilt from this sequence in
    this lookup round: ``new_round`` starts one)."""

    __slots__ = ("_pos", "_fresh")

    def __init__(self) -> None:
        self._pos: dict[str, int] = {}
        self._fresh = False  # the map was built from the current round's sequence

    def new_round(self) -> None:
        self._fresh = False

    def find(self, replicas: Sequence[ReplicaLoad], rid: str) -> int | None:
        i = self._pos.get(rid)
        if i is not None and i < len(replicas) and replicas[i].replica_id == rid:
            return i
        if self._fresh:
            return None
        self._pos = dict(zip(map(replica_id_of, replicas), range(len(replicas))))
        self._fresh = True
        return self._pos.get(rid)


@dataclass(slots=True, frozen=True)
class TTFTAdmission:
    """The TTFT admission rule (module docstring).

    Args:
        factor: a replica is admissible while its estimated TTFT is at most this times
            the lowest estimate (>= 1).
        prefill_lanes: prefill batches a replica runs at once (the queue drains this
            many times faster than one request's prefill; >= 1).
        wait_cost: prefill tokens of delay one unstarted request at a replica stands
            for in the saturation rule (>= 0; 0, the default here: no replica is
            saturated; ``CacheAwarePolicy`` passes its ``request_cost_tokens``).
    """

    factor: float = 2.0
    prefill_lanes: int = 4
    wait_cost: float = 0.0
    _positions: ReplicaPositions = field(default_factory=ReplicaPositions, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError("the admission factor must be >= 1")
        if self.prefill_lanes < 1:
            raise ValueError("prefill_lanes must be >= 1")
        if not self.wait_cost >= 0.0:
            raise ValueError("wait_cost must be >= 0")

    def unstarted_delay(self, load: ReplicaLoad) -> float:
        """``sat - est`` for ``load``'s replica: ``wait_cost`` times its requests not
        started yet (``outstanding`` less ``running``; 0 when none or ``wait_cost`` is 0)."""
        u = (load.in_flight if load.in_flight > load.running + load.waiting else load.running + load.waiting) - load.running
        return self.wait_cost * u if u > 0 and self.wait_cost else 0.0

    def estimate(self, num_prompt_tokens: int, block_size: int, matched_blocks: int, load: ReplicaLoad,
                 queue_share: float = 1.0) -> float:
        """Estimated TTFT on ``load``'s replica, in prefill tokens."""
        uncached = max(0, num_prompt_tokens - block_size * matched_blocks)
        return uncached + load.queued_prefill_tokens * queue_share / self.prefill_lanes

    def decided_by_matches(self, replicas: Sequence[ReplicaLoad], num_prompt_tokens: int, block_size: int,
                           matches: Mapping[str, int], queue_share: Mapping[str, float] | None = None,
                           ) -> list[ReplicaLoad] | None:
        """``admissible``'s result when the matching replicas decide it alone (no other
        replica can be admissible; a fleet of at least ``MATCHES_FIRST_MIN_REPLICAS`` with
        at most one in ``MATCHES_FIRST_MAX_SHARE`` matching), else None. Costs a look at
        the matching replicas only."""
        if len(replicas) >= MATCHES_FIRST_MIN_REPLICAS and 0 < len(matches) * MATCHES_FIRST_MAX_SHARE <= len(replicas):
            return self._among_matches(replicas, num_prompt_tokens, block_size, matches, queue_share)
        return None

    def admissible(self, replicas: Sequence[ReplicaLoad], num_prompt_tokens: int, block_size: int,
                   matches: Mapping[str, int], queue_share: Mapping[str, float] | None = None) -> list[ReplicaLoad]:
        """The replicas whose estimate is within ``factor`` of the best (``matches``: the
        index's leading-block match per replica; a replica left out matches 0;
        ``queue_share``: the uncached share of a replica's queue, 1 where left out)."""
        found = self.decided_by_matches(replicas, num_prompt_tokens, block_size, matches, queue_share)
        if found is not None:
            return found
        # NOTE: ``estimate`` inlined (the router runs this per request over every replica)
        # (``u if u > 0 else 0`` is ``max(0, u)`` on ints, without a call per replica)
        lanes, get, n, bs = self.prefill_lanes, matches.get, num_prompt_tokens, block_size
        if not matches:  # no replica holds the first block: every uncached part is n (>= 0)
            if queue_share:
                share = queue_share.get
                est = [n + r.queued_prefill_tokens * share(r.replica_id, 1.0) / lanes for r in replicas]
            else:
                est = [n + r.queued_prefill_tokens / lanes for r in replicas]
        elif queue_share:
            share = queue_share.get
            est = [(u if (u := n - bs * get(r.replica_id, 0)) > 0 else 0)
                   + r.queued_prefill_tokens * share(r.replica_id, 1.0) / lanes for r in replicas]
        else:
            est = [(u if (u := n - bs * get(r.replica_id, 0)) > 0 else 0) + r.queued_prefill_tokens / lanes
                   for r in replicas]
        cap = self.factor * min(est)
        if self.wait_cost:
            # NOTE: ``unstarted_delay`` inlined (the same expression, so the same floats)
            wc = self.wait_cost
            delays = [wc * u if (u := (f if (f := r.in_flight) > (o := r.running + r.waiting) else o) - r.running) > 0
                      else 0.0 for r in replicas]
            if any(delays):  # else no replica is saturated (sat = est)
                sat = [e + d for e, d in zip(est, delays)]
                sat_cap = self.factor * min(sat) + wc  # one unstarted request is always tolerated
                return ([r for r, e, x in zip(replicas, est, sat) if e <= cap and x <= sat_cap]
                        or [r for r, x in zip(replicas, sat) if x <= sat_cap])
        if max(est) <= cap:
            return list(replicas)  # every one (a quiet fleet): no filtering pass
        return [r for r, e in zip(replicas, est) if e <= cap]

    def admissible_timed(self, replicas: Sequence[ReplicaLoad], num_prompt_tokens: int, block_size: int,
                         matches: Mapping[str, int], queue_share: Mapping[str, float] | None,
                         costs: Callable[[str], Costs]) -> list[ReplicaLoad]:
        """``admissible`` priced in each replica's own seconds (``costs(r)``: its fitted
        ``Costs``, ``unicache.router.routing.cost_model``), the same two rules:

            est_r = a_r + b_r * (uncached_r + queue_r / lanes)
            sat_r = est_r + s_r * unstarted_r        (s_r: seconds per outstanding request)

        admissible while est_r <= factor * min est and sat_r <= factor * min sat + s_r (one
        unstarted request tolerated); when that leaves none, the replicas within the
        saturation bound. Decoding requests do not count in est, as in prefill tokens."""
        lanes, get, n, bs = self.prefill_lanes, matches.get, num_prompt_tokens, block_size
        share = queue_share.get if queue_share else None
        est, sat, tol = [], [], []
        for r in replicas:
            rid = r.replica_id
            c = costs(rid)
            u = n - bs * get(rid, 0)
            q = r.queued_prefill_tokens * (share(rid, 1.0) if share is not None else 1.0) / lanes
            e = c.prefill_base_s + c.prefill_per_token_s * ((u if u > 0 else 0) + q)
            w = c.per_outstanding_s if self.wait_cost else 0.0
            unstarted = (r.in_flight if r.in_flight > r.running + r.waiting else r.running + r.waiting) - r.running
            est.append(e)
            sat.append(e + w * unstarted if unstarted > 0 else e)
            tol.append(w)
        cap = self.factor * min(est)
        sat_floor = self.factor * min(sat)
        return ([r for r, e, x, t in zip(replicas, est, sat, tol) if e <= cap and x <= sat_floor + t]
                or [r for r, x, t in zip(replicas, sat, tol) if x <= sat_floor + t])

    def _among_matches(self, replicas: Sequence[ReplicaLoad], num_prompt_tokens: int, block_size: int,
                       matches: Mapping[str, int], queue_share: Mapping[str, float] | None) -> list[ReplicaLoad] | None:
        """``admissible``'s result found among the replicas in ``matches`` alone, or None
        when that cannot be decided there.

        Exact: every other replica estimates N + (its queue) >= N, and its ``sat`` is no
        less (floats: N is exact and adding a non-negative number never rounds below it).
        If ``factor * best < N`` for the lowest estimate ``best`` among the matching
        replicas, that is the lowest overall, the cap is the same float, and no other
        replica is within it; the same for ``sat`` when some replica is saturated. Estimates
        are computed with the full pass's expressions, so equal inputs give equal floats."""
        lanes = self.prefill_lanes
        positions = self._positions
        positions.new_round()
        share = queue_share.get if queue_share else None
        found: list[tuple[int, float, float]] = []
        wait = self.wait_cost
        for rid, m in matches.items():
            i = positions.find(replicas, rid)
            if i is None:
                continue  # not offered (quarantined, excluded)
            r = replicas[i]
            uncached = max(0, num_prompt_tokens - block_size * m)
            if share is not None:
                e = uncached + r.queued_prefill_tokens * share(rid, 1.0) / lanes
            else:
                e = uncached + r.queued_prefill_tokens / lanes
            found.append((i, e, e + self.unstarted_delay(r) if wait else e))
        if not found:
            return None
        cap = self.factor * min(e for _, e, _ in found)
        if not cap < num_prompt_tokens:
            return None
        found.sort()
        if wait and any(x != e for _, e, x in found):
            sat_cap = self.factor * min(x for _, _, x in found) + wait
            if not sat_cap < num_prompt_tokens:
                return None
            return ([replicas[i] for i, e, x in found if e <= cap and x <= sat_cap]
                    or [replicas[i] for i, _, x in found if x <= sat_cap])
        return [replicas[i] for i, e, _ in found if e <= cap]
