"""Should ``cache_aware`` prefer replicas with room for the request's KV blocks?

On every family of the routing suite the binding resource is KV memory, not prefill: at
the report's 2% capacity, the blocks decoding requests hold reach the replicas' capacity
at load u = 1 while prefill lanes are at 1-5% (``bench.routing_report.nominal_scale``).
A replica whose free blocks (free plus evictable cached ones) cannot hold a request and
the requests already waiting there makes it wait for running requests to finish; the
pooled replica (the routing report's reference) never strands a request that way while
another replica has room. ``cache_aware``'s TTFT admission estimates only the prefill
queue.

Variants, all against the policy without it (``fit_first=False``, "without fit-first"):
``cache_aware``'s own fit-first (shipped since this study: among the replicas TTFT
admission admits, keep those where the request fits now,

    free_blocks_r - queued_prefill_tokens_r / B >= ceil(N / B)

the request's prompt blocks, cached ones included, since a matched block leaves the
evictable pool too; the output's blocks are unknown to a router; ``with_room``), which
judges a session's home before filtering; and this study's ``FitFirstPolicy`` (never
registered), which filters before the home check too (``fit-first, session homes too``),
or also looks beyond the admissible set when no admissible replica has room (``fit-first,
any replica``).

Tuning traces only (``bench.studies.routing_admission``'s), 4 and 8 replicas; scores
against the policy without fit-first and sglang + unicache.

Writes ``kv_admission.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.kv_admission [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy, with_room

DEFAULT = "without fit-first"


class FitFirstPolicy(CacheAwarePolicy):
    """``cache_aware`` that filters by room (``with_room``) inside admission, so a session's
    home must have room too (``any_replica``: if no admissible replica has room, any
    replica with room)."""

    def __init__(self, any_replica: bool = False, **kwargs):
        super().__init__(fit_first=False, **kwargs)
        self.any_replica = any_replica

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        admissible = super()._admissible(replicas, n_tokens, block_size, matches)
        # NOTE: ``with_room`` hands back its own argument when no replica in it has room.
        room = with_room(admissible, n_tokens, block_size)
        if room is admissible and self.any_replica:
            room = with_room(replicas, n_tokens, block_size)
            if room is replicas:
                return admissible  # nobody has room
        return room


VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {"fit_first": False}),
    "fit-first (shipped)": (CacheAwarePolicy, {}),
    "fit-first, session homes too": (FitFirstPolicy, {}),
    "fit-first, any replica": (FitFirstPolicy, {"any_replica": True}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.kv_admission", __doc__, argv, VARIANTS, DEFAULT, "kv_admission",
                        "cache_aware preferring replicas with room for the request's blocks")


if __name__ == "__main__":
    sys.exit(main())
