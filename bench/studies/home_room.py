"""Should a session's turn leave its home when the home has no room for its blocks?

``cache_aware`` keeps a session's turn on the replica of its previous turn (its home)
while the home is admissible (TTFT admission: the prefill queue) and still holds the
session's blocks; fit-first (prefer replicas whose free blocks hold the request beyond
what their queues claim, ``with_room``) is applied only after that check. On the chat
tuning trace chat-p1001-s1000 at 8 replicas just above ``cache_aware``'s goodput, 30 of
the 44 turns slower than the SLO were kept at a home with 15-74 free blocks for a prompt
of 169-922 blocks while 2-5 other replicas had empty queues: they waited up to 3.8 s for
running requests to free blocks (a diagnostic, not committed; pooled reaches 5.18 u there,
``cache_aware`` 3.98, sglang 2.13). ``bench.studies.kv_admission`` measured filtering the
home by the full room rule: agent lost (0.974x / 0.929x), since a moved turn recomputes its
context. Here the home must hold a fraction of the need:

    free_blocks_home - queued_prefill_tokens_home / B >= frac * ceil(N / B)

else the turn takes the cost path (where fit-first applies).

Variants (tuning traces only, ``bench.studies.routing_admission``'s; 4 and 8 replicas):

    * ``shipped``: the home is judged before fit-first;
    * ``home room 1.0`` / ``0.5`` / ``0.25``: ``HomeRoomPolicy`` with that fraction.

Result (26 tuning traces, bench/results/home_room.md): every fraction loses, on chat too:
1.0 / 0.5 / 0.25 score 0.965x / 0.966x / 0.975x the shipped policy at 4 replicas and
0.911x / 0.901x / 0.895x at 8 (chat 0.95-0.96x and 0.89-0.91x, agent 0.90-0.99x and
0.89-0.92x, template down to 0.75x). Turns kept waiting for blocks at home cost the p90
less than the recomputation a move costs every moved turn (and the replica it lands on).
Not adopted.

Writes ``home_room.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.home_room [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.studies.variant_study import run_variants
from unicache.block_hash import BlockHash
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware import CacheAwarePolicy


class HomeRoomPolicy(CacheAwarePolicy):
    """``cache_aware`` whose session home must have room for ``home_room_frac`` of the
    turn's prompt blocks beyond its queue's claim (module docstring)."""

    def __init__(self, home_room_frac: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.home_room_frac = home_room_frac
        self._request: RoutingRequest | None = None

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index) -> RouteDecision:
        self._request = request
        return super().choose(request, replicas, index)

    def _session_home(self, prev, hashes: Sequence[BlockHash], admissible: Sequence[ReplicaLoad], index,
                      matches: dict[str, int]) -> RouteDecision | None:
        decision = super()._session_home(prev, hashes, admissible, index, matches)
        if decision is None or decision.reason != "session_home":
            return decision
        req = self._request
        bs = req.block_size
        need = -(-req.num_prompt_tokens // bs)
        home = next(r for r in admissible if r.replica_id == decision.replica_id)
        if home.free_blocks - home.queued_prefill_tokens / bs >= self.home_room_frac * need:
            return decision
        return None


DEFAULT = "shipped"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "home room 1.0": (HomeRoomPolicy, {"home_room_frac": 1.0}),
    "home room 0.5": (HomeRoomPolicy, {"home_room_frac": 0.5}),
    "home room 0.25": (HomeRoomPolicy, {"home_room_frac": 0.25}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.home_room", __doc__, argv, VARIANTS, DEFAULT, "home_room",
                        "cache_aware: a session's home without room for the turn")


if __name__ == "__main__":
    sys.exit(main())
