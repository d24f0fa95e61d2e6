"""Would ``cache_aware`` route better if it knew how much of a replica's queue is cached?

``cache_aware`` weighs a replica's queue by ``queued_prefill_tokens``: the whole prompts
of the requests waiting there, cached parts included, because an engine (and the
simulator) learns a request's match only when it schedules it. On traffic whose turns
are mostly cached (the agent family hits ~88% of tokens) that figure overstates the work
ahead several times over, in the TTFT admission rule (``est = uncached + queue / lanes``)
and in the cost's load term alike.

This study replays the tuning traces with an oracle the router cannot have live: the
simulator reports each replica's queue as the *uncached* tokens of its waiting requests,
matched against the replica's cache at every routing decision (``UncachedQueueReplay``,
this study's ``Replay`` subclass); the policy is unchanged. If even the oracle does not
raise goodput, a router-side estimate of it (each routed request's uncached tokens by the
index, until its first token) is not worth building.

Tuning traces only (``bench.studies.routing_admission``'s), 4 and 8 replicas, the routing
report's goodput machinery; scores against the shipped default (same policy, the usual
queue figure) and sglang + unicache.

Writes ``queue_estimate.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.queue_estimate [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay

DEFAULT = "default (whole prompts queued)"
ORACLE = "oracle: uncached tokens queued"


class UncachedQueueReplay(Replay):
    """Reports each replica's queue as the uncached tokens of its waiting requests, matched
    against its cache now (a lower bound on the prefill work they will need)."""

    def _snapshot(self) -> list[ReplicaLoad]:
        loads = super()._snapshot()
        bs = self.block_size
        out = []
        for rep, load in zip(self.replicas, loads):
            match = rep.store.match_prefix
            queued = sum(max(0, r.input_length - bs * match(r.prompt_hashes[: r.reusable_blocks])) for r in rep.waiting)
            out.append(replace(load, queued_prefill_tokens=queued))
        return out


VARIANTS = {DEFAULT: (CacheAwarePolicy, {}), ORACLE: (CacheAwarePolicy, {})}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.queue_estimate", __doc__, argv, VARIANTS, DEFAULT, "queue_estimate",
                        "cache_aware with an oracle of the uncached work queued", replays={ORACLE: UncachedQueueReplay})


if __name__ == "__main__":
    sys.exit(main())
