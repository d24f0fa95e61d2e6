"""A router-side estimate of how much of a replica's queue is cached, against the oracle.

Replicas publish their queue as whole prompts (``queued_prefill_tokens``): an engine
learns a request's match only when it schedules it. On agent traffic, where turns are
mostly cached, that overstates the prefill work ahead several times, and ``cache_aware``
reads it three ways: the TTFT admission estimate, the cost's load term, and fit-first's
room. An oracle of the uncached work queued (``UncachedQueueReplay``: each replica's queue
re-matched against its cache at every decision) raised goodput only 1.4% / 1.2% before
fit-first (this study's predecessor); with fit-first shipped it scored well on the agent
tuning traces where sglang beat ``cache_aware`` (agent-p1003 at 4 replicas: 2.03 against
1.66).

The router can estimate that share itself: every request it routes has an uncached part
by the index at that moment (``N - B * matched_blocks``). It keeps, per replica, the
sums of uncached and whole prompt tokens of its requests there that have not produced
their first token yet, and scales the published figure by their ratio,

    queued_r' = queued_prefill_tokens_r * uncached_r / whole_r     (whole_r > 0; else as is)

(``cache_aware``'s ``queue_share``, shipped since this study; the simulator tells the
policy each request's first token at the end of its prefill, where the live router sees
the replica's first message).

Variants, against the policy without it (``queue_share=False``, whole prompts):

    * ``queue share (shipped)``: the estimate in the TTFT admission estimate and the
      cost's load term; fit-first's room and the eviction pressure keep whole prompts (a
      queued request claims its cached blocks too);
    * ``queue share, everywhere``: the estimate in room and pressure too
      (``ShareEverywherePolicy``, this study's);
    * ``oracle``: without the estimate, but each replica's waiting requests reported as
      their uncached tokens, re-matched at every decision (``UncachedQueueReplay``; the
      requests being prefilled as published, whole).

Tuning traces only (``bench.studies.routing_admission``'s), 4 and 8 replicas; scores
against the policy without the estimate and sglang + unicache.

Writes ``queue_share.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.queue_share [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay

DEFAULT = "whole prompts (no queue share)"


class UncachedQueueReplay(Replay):
    """Reports each replica's waiting requests as their uncached tokens, matched against
    its cache now (a lower bound on the prefill work they will need); the requests being
    prefilled stay as published, whole prompts."""

    def _snapshot(self) -> list[ReplicaLoad]:
        loads = super()._snapshot()
        bs = self.block_size
        out = []
        for rep, load in zip(self.replicas, loads):
            match = rep.store.match_prefix
            waiting = rep.waiting
            prefilling = load.queued_prefill_tokens - sum(r.prompt_tokens for r in waiting)
            queued = prefilling + sum(max(0, r.input_length - bs * match(r.prompt_hashes[: r.reusable_blocks]))
                                      for r in waiting)
            out.append(replace(load, queued_prefill_tokens=queued))
        return out


class ShareEverywherePolicy(CacheAwarePolicy):
    """``cache_aware`` with its queue share applied to the published queue itself, so
    fit-first's room and the eviction pressure read the scaled figure too."""

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        queues = self._queues
        share = queues.share
        if not share:
            return super().choose(request, replicas, index)
        scaled = [replace(r, queued_prefill_tokens=int(r.queued_prefill_tokens * share[r.replica_id]))
                  if r.replica_id in share else r for r in replicas]
        queues.share = {}  # NOTE: already applied; the policy must not scale twice
        try:
            return super().choose(request, scaled, index)
        finally:
            queues.share = share


VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {"queue_share": False}),
    "queue share (shipped)": (CacheAwarePolicy, {}),
    "queue share, everywhere": (ShareEverywherePolicy, {}),
    "oracle": (CacheAwarePolicy, {"queue_share": False}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.queue_share", __doc__, argv, VARIANTS, DEFAULT, "queue_share",
                        "cache_aware with a router-side estimate of the uncached share of each queue",
                        replays={"oracle": UncachedQueueReplay})


if __name__ == "__main__":
    sys.exit(main())
