"""How many blocks should fit-first ask a replica to have free for a request?

``cache_aware``'s fit-first (``with_room``) keeps, of the admissible replicas, those whose
free blocks (free plus evictable cached ones) hold the request's whole prompt beyond what
their queues need, ``ceil(N / B)`` blocks, cached ones included: a matched block that no
running request holds is counted in ``free_blocks`` and leaves the evictable pool when
the request takes it. But a matched block that running requests hold is not in
``free_blocks`` at all, and taking it costs nothing. Agent traffic is made of exactly
that: many sessions of one agent share a long system prompt (hundreds of blocks), held
by whichever of them runs. On an agent tuning trace (agent-p1003-s1000, 4 replicas,
u = 1, before the queue share) 15 of 59 first turns were sent away from the replica holding their agent's
prompt because it showed no room for the whole prompt, each copying the prompt to a
second replica; sglang, which ignores memory, kept every agent's sessions on one
replica and hit 0.877 of tokens against 0.857.

The router cannot tell which matched blocks are held (the index publishes holdings, not
references). Variants bracket it, all against the shipped rule (``fit-first (shipped)``):

    * ``new blocks only``: need_r = ceil(N / B) - m_r (every matched block held: the
      optimistic bound, which favours the replica holding the prefix);
    * ``half the matched``: need_r = ceil(N / B) - m_r / 2;
    * ``without fit-first``: no room filter at all.

``m_r``: the index's leading-block match on r (GPU tier). Tuning traces only
(``bench.studies.routing_admission``'s), 4 and 8 replicas; scores against the shipped
rule and sglang + unicache.

Result (with the queue share shipped): neither bound helps, 0.994x / 0.997x the shipped
rule's goodput at 4 / 8 replicas for ``new blocks only`` (agent 0.970x / 0.988x) and
0.997x / 0.998x for ``half the matched``; without fit-first 0.971x / 0.953x. The shipped
rule stays.

Writes ``room_need.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.room_need [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy

DEFAULT = "fit-first (shipped)"


class RoomNeedPolicy(CacheAwarePolicy):
    """``cache_aware`` whose fit-first asks each replica for ``ceil(N / B) - credit * m_r``
    free blocks (``credit`` 0 is the shipped rule)."""

    def __init__(self, credit: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.credit = credit

    def _with_room(self, admissible: list[ReplicaLoad], n_tokens: int, block_size: int,
                   matches: dict[str, int]) -> list[ReplicaLoad]:
        need = -(-n_tokens // block_size)
        credit, get = self.credit, matches.get
        room = [r for r in admissible
                if r.free_blocks - r.queued_prefill_tokens / block_size >= need - credit * get(r.replica_id, 0)]
        return room or admissible


VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "new blocks only": (RoomNeedPolicy, {"credit": 1.0}),
    "half the matched": (RoomNeedPolicy, {"credit": 0.5}),
    "without fit-first": (CacheAwarePolicy, {"fit_first": False}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.room_need", __doc__, argv, VARIANTS, DEFAULT, "room_need",
                        "fit-first's room: the whole prompt, or only the blocks a replica lacks")


if __name__ == "__main__":
    sys.exit(main())
