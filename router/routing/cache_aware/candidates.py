"""The replicas a decision weighs in a large fleet: every replica that could hit the
prompt, plus a window of the others that moves with each routed request.

A prompt that no replica holds makes every replica a candidate, and ``cache_aware``
computes the TTFT admission estimate, fit-first's room and the cost for each: at 1,024
replicas that is about 0.6 us per replica, a decision that grows with the fleet (issue 17
asks that it grow only with the replicas holding a matching prefix). The replicas that
hold nothing of the prompt differ only by their load terms (queue, outstanding requests,
churn inflow, session footprint), and for spreading load a sample of them does nearly as
well as all: the best of d random choices (Mitzenmacher's power of d choices) is within
the lightest d-quantile of the fleet.

So in a fleet of more than ``size`` replicas, ``select`` returns:
    * every replica named in ``keep`` that the fleet offers (the caller names those that
      could hit the prompt: the index's holders of its first block, but for a prefix
      more than half the fleet holds only those that go beyond it, host-tier runs (past
      each replica's GPU match, a grouped one's included), blocks in flight, the
      session's replica, the template's home),
    * the replica with the fewest queued prefill tokens (the first of them in the
      fleet's order; one pass at C speed): for a prompt no replica holds, the one with
      the lowest TTFT estimate, so TTFT admission keeps the reference the whole fleet
      would give it (without it, a holder with a long queue stayed admissible against a
      window of busy replicas: on a tuning workload of the ``candidate_window`` study, docs/studies.md
      at 256 replicas the window alone raised TTFT mean 1.06-1.22x), and
    * ``size`` consecutive replicas of the fleet's sequence (wrapping around), starting
      at ``(clock * size) mod n``, ``clock`` the decision clock (requests routed so far).
Consecutive requests see consecutive windows, so every replica is weighed at least once
every ceil(n / size) requests; the window is a function of the clock, which the routers
sharing terms share, not of a random generator, so a replay is exact and routers with the
same view decide alike.

Invariants:
    * For ``size`` 0 or a fleet of at most ``size`` replicas, ``select`` returns the
      fleet's sequence itself: decisions in such fleets are unchanged by this module.
    * Otherwise the result keeps the fleet's order, holds no replica twice, and holds
      every replica in ``keep`` that the fleet offers and the least-queued one, plus
      ``size`` others at most (the window's members).
    * When the kept replicas are at least half the fleet the fleet is returned whole (the
      sample would save little, and finding them costs a lookup each).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware.admission import ReplicaPositions

_QUEUED = attrgetter("queued_prefill_tokens")


class CandidateWindow:
    """``select``'s window of ``size`` replicas (module docstring); 0 turns it off."""

    __slots__ = ("size", "_positions")

    def __init__(self, size: int):
        if size < 0:
            raise ValueError("the candidate window must be >= 0 (0: every replica)")
        self.size = size
        self._positions = ReplicaPositions()

    def applies(self, fleet_size: int) -> bool:
        """Whether a fleet of ``fleet_size`` replicas is sampled at all."""
        return 0 < self.size < fleet_size

    def select(self, replicas: Sequence[ReplicaLoad], keep: Sequence[str | None], clock: int) -> Sequence[ReplicaLoad]:
        """The candidates among ``replicas`` (``keep``: ids to weigh whatever the window;
        None entries are ignored)."""
        n, k = len(replicas), self.size
        if not self.applies(n) or 2 * len(keep) >= n:
            return replicas
        start = (clock * k) % n
        end = start + k
        wrap = end - n  # > 0: the window's tail continues at the fleet's start
        positions = self._positions
        positions.new_round()
        queued = [*map(_QUEUED, replicas)]
        least = queued.index(min(queued))
        extra: list[int] = [] if start <= least < end or least < wrap else [least]
        for rid in keep:
            if rid is None:
                continue
            i = positions.find(replicas, rid)
            if i is None or start <= i < end or i < wrap:
                continue  # not offered (quarantined, excluded), or in the window already
            extra.append(i)
        if wrap > 0:
            picked = [*range(wrap), *range(start, n)]
        else:
            picked = list(range(start, end))
        if extra:
            picked.extend(set(extra))
            picked.sort()
        return [replicas[i] for i in picked]
