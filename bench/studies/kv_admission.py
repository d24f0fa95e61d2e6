"""Should ``cache_aware`` prefer replicas with room for the request's KV blocks?

On every family of the routing suite the binding resource is KV memory, not prefill: at
the report's 2% capacity, the blocks decoding requests hold reach the replicas' capacity
at load u = 1 while prefill lanes are at 1-5% (``bench.routing_report.nominal_scale``).
A replica whose free blocks (free plus evictable cached ones) cannot hold a request and
the requests already waiting there makes it wait for running requests to finish; the
pooled replica (the routing report's reference) never strands a request that way while
another replica has room. ``cache_aware``'s TTFT admission estimates only the prefill
queue.

Variants (this study's ``FitFirstPolicy``, never registered): among the replicas TTFT
admission admits, keep those where the request fits now,

    free_blocks_r - queued_prefill_tokens_r / B >= ceil(N / B)

(the request's prompt blocks, cached ones included, since a matched block leaves the
evictable pool too; the output's blocks are unknown to a router) when any does
(``fit-first``); or look beyond the admissible set too: any replica where it fits, if no
admissible one has room (``fit-first, any replica``); or fit-first except for a session's
home, which is judged on the unfiltered set as before (``fit-first, sessions stay home``:
moving a session recomputes its context). Otherwise the policy is unchanged.

Tuning traces only (``bench.studies.routing_admission``'s), 4 and 8 replicas; scores
against the shipped default and sglang + unicache.

Writes ``kv_admission.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.kv_admission [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.studies.session_admission import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy

DEFAULT = "default"


class FitFirstPolicy(CacheAwarePolicy):
    """``cache_aware`` whose admissible set keeps only the replicas with room for the
    request's blocks, when one has (``any_replica``: else any replica with room)."""

    def __init__(self, any_replica: bool = False, sessions_stay: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.any_replica = any_replica
        self.sessions_stay = sessions_stay
        self._unfiltered: list[ReplicaLoad] = []

    def _session_home(self, prev, hashes, admissible, index, matches):
        if self.sessions_stay:
            admissible = self._unfiltered  # a session's home is judged as before
        return super()._session_home(prev, hashes, admissible, index, matches)

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        admissible = self._unfiltered = super()._admissible(replicas, n_tokens, block_size, matches)
        need = -(-n_tokens // block_size)

        def fits(r: ReplicaLoad) -> bool:
            return r.free_blocks - r.queued_prefill_tokens / block_size >= need

        room = [r for r in admissible if fits(r)]
        if room:
            return room
        if self.any_replica:
            room = [r for r in replicas if fits(r)]
        return room or admissible


VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "fit-first": (FitFirstPolicy, {}),
    "fit-first, any replica": (FitFirstPolicy, {"any_replica": True}),
    "fit-first, sessions stay home": (FitFirstPolicy, {"sessions_stay": True}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.kv_admission", __doc__, argv, VARIANTS, DEFAULT, "kv_admission",
                        "cache_aware preferring replicas with room for the request's blocks")


if __name__ == "__main__":
    sys.exit(main())
