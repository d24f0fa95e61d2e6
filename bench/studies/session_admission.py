"""Should an explicit session leave a busy home sooner (or later) than other requests?

``cache_aware`` sends a session's next turn to its previous turn's replica unless that
replica is not *admissible*: its estimated TTFT (uncached prompt tokens + queued prefill
tokens / lanes) above ``admission_factor`` (2.0) x the best replica's
(``unicache.router.routing.admission``). The routing report's pooled reference puts the
agent family furthest from what one pooled replica reaches (0.65 of its goodput at 4
replicas) with every router hitting the same share of tokens there, so the distance is
queueing: turns of sessions kept home wait for one replica's lanes. This study gives the
home check its own factor (``SessionAdmissionPolicy``, this study's subclass, never
registered): below 2.0 a turn leaves a busy home sooner (its placement then goes to the
cost, which still weighs the home's cached prefix), above 2.0 later.

Tuning traces only (``bench.studies.routing_admission``'s: generated points 1000.. and
Mooncake slices 0-1 of 8; none is a report trace), 4 and 8 replicas, goodput and metrics
by the routing report's own machinery. Scores: geometric mean of per-trace goodput ratios
against the shipped default and against sglang + unicache, overall and per family.

Writes ``session_admission.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.session_admission [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.studies.variant_study import run_variants
from unicache.router.routing.admission import TTFTAdmission
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy

DEFAULT = "default (home factor 2.0)"


class SessionAdmissionPolicy(CacheAwarePolicy):
    """``cache_aware`` whose session-home check uses ``session_admission_factor`` instead
    of ``admission_factor`` (every other decision unchanged)."""

    def __init__(self, session_admission_factor: float = 1.5, **kwargs):
        super().__init__(**kwargs)
        self.session_admission = TTFTAdmission(session_admission_factor, self.admission.prefill_lanes)
        self._home_admissible: list[ReplicaLoad] = []

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        self._home_admissible = self.session_admission.admissible(replicas, n_tokens, block_size, matches)
        return super()._admissible(replicas, n_tokens, block_size, matches)

    def _session_home(self, prev, hashes, admissible, index, matches):
        return super()._session_home(prev, hashes, self._home_admissible, index, matches)


VARIANTS: dict[str, tuple[type[CacheAwarePolicy], dict]] = {
    DEFAULT: (CacheAwarePolicy, {}),
    "home factor 1.25": (SessionAdmissionPolicy, {"session_admission_factor": 1.25}),
    "home factor 1.5": (SessionAdmissionPolicy, {"session_admission_factor": 1.5}),
    "home factor 3.0": (SessionAdmissionPolicy, {"session_admission_factor": 3.0}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.session_admission", __doc__, argv, VARIANTS, DEFAULT, "session_admission",
                        "A session's home: its own admission factor")


if __name__ == "__main__":
    sys.exit(main())
