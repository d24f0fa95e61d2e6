"""Fit-first's room and the eviction pressure: the whole queue, or what it still takes.

``cache_aware`` keeps, of the admissible replicas, those with free blocks for the request
beyond what their queues need (``with_room``: free_blocks - queued / B >= ceil(N / B)),
and discounts a cached match by the eviction pressure min(1, (queued / B) / free_blocks).
Since replicas publish the whole prompts of every request without a first token
(waiting or being prefilled), a request whose prefill runs is counted twice there: its
blocks are already allocated (gone from ``free_blocks``) and its prompt is still in the
queue. Would the room be better judged by what the queue still takes from the free
pool, the waiting requests' prompts only (no blocks allocated yet)? Replicas do not
publish that figure; here the study's replay hands it to the study's policy
(``UnallocatedRoomReplay``, ``UnallocatedRoomPolicy``), which uses it for fit-first's room
only (the eviction pressure is inline in ``choose`` and keeps the whole queue).

Variants (tuning traces only, ``bench.studies.routing_admission``'s; 4 and 8 replicas):

    * ``whole queue (shipped)``: the room and pressure from ``queued_prefill_tokens``;
    * ``room from waiting prompts``: fit-first's room from the waiting requests' prompts;
    * ``no fit-first``: the filter off (how much the room rule is worth at all).

Result (26 tuning traces, 6.7 min, bench/results/room_unallocated.md): the room from the
waiting prompts scored 1.009x / 1.010x the shipped rule at 4 / 8 replicas (13 / 7 and 11 / 9
traces above / below; token hits +0.01 / +0.10 points), within the swing of single
traces; fit-first itself is worth 1 / 0.954 and 1 / 0.949 (without it 7 / 17 and 3 / 18).
Not adopted: a gain that size does not pay for a new figure every engine would have to
publish (the vLLM engine learns which requests vLLM scheduled only inside its scheduler).

Writes ``room_unallocated.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.room_unallocated [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay


class UnallocatedRoomPolicy(CacheAwarePolicy):
    """``cache_aware`` whose fit-first room counts only the prompts of requests waiting
    to be scheduled (``waiting_tokens``, set by ``UnallocatedRoomReplay`` before each
    decision): free_blocks - waiting / B >= ceil(N / B)."""

    waiting_tokens: dict[str, int] = {}

    def _with_room(self, admissible: list[ReplicaLoad], n_tokens: int, block_size: int,
                   matches: dict[str, int]) -> list[ReplicaLoad]:
        need = -(-n_tokens // block_size)
        waiting = self.waiting_tokens
        room = [r for r in admissible if r.free_blocks - waiting.get(r.replica_id, 0) / block_size >= need]
        return room or admissible


class UnallocatedRoomReplay(Replay):
    """Hands an ``UnallocatedRoomPolicy`` each replica's waiting prompts with its loads."""

    def _snapshot(self) -> list[ReplicaLoad]:
        loads = super()._snapshot()
        if isinstance(self.router, UnallocatedRoomPolicy):
            self.router.waiting_tokens = {rep.replica_id: sum(r.prompt_tokens for r in rep.waiting)
                                          for rep in self.replicas}
        return loads


DEFAULT = "whole queue (shipped)"
ROOM = "room from waiting prompts"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    ROOM: (UnallocatedRoomPolicy, {}),
    "no fit-first": (CacheAwarePolicy, {"fit_first": False}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.room_unallocated", __doc__, argv, VARIANTS, DEFAULT, "room_unallocated",
                        "cache_aware's fit-first room: the whole queue or its waiting part",
                        replays={ROOM: UnallocatedRoomReplay})


if __name__ == "__main__":
    sys.exit(main())
