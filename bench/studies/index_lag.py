"""What does a lagging index cost ``cache_aware``, and does counting in-flight prompts win it back?

A live router's ``LocalityIndex`` learns of a replica's cached blocks from the replica's
event batches, which its publisher flushes every ``EVENT_FLUSH_INTERVAL_S`` (0.05 s), so
a prompt's blocks reach the index up to one flush after its prefill ends (the fault test
``router_restart`` measured the index 120 blocks behind, caught up 63 ms later). Every
routing figure so far came from a simulator whose index never lagged, and there
``track_inflight`` (count the blocks of requests routed but not finished as held by their
replica) cost hit ratio and TTFT. The replay now models the publisher
(``ReplayConfig.index_flush_s``); this study replays ``cache_aware`` with the index
lagging as live (50 ms), lagging less (10 ms: a shorter flush period), and not at all, with
and without ``track_inflight``. sglang + unicache keeps its own trees and never reads the
index, so lag cannot touch it.

Tuning traces only (``bench.studies.routing_admission``'s), 4 and 8 replicas; scores
against the live condition with the shipped default and against sglang + unicache.

Writes ``index_lag.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.index_lag [--points 4] [--workers 2]
"""

from __future__ import annotations

import dataclasses
import sys

from bench.studies.variant_study import run_variants
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay


class _LaggedReplay(Replay):
    """``Replay`` with the index lagging by ``FLUSH_S`` (a class per period, so a worker
    process can unpickle it by name)."""

    FLUSH_S = 0.0

    def __init__(self, trace, config, *args, **kwargs):
        super().__init__(trace, dataclasses.replace(config, index_flush_s=self.FLUSH_S), *args, **kwargs)


class Lag50(_LaggedReplay):
    FLUSH_S = 0.05


class Lag10(_LaggedReplay):
    FLUSH_S = 0.01


DEFAULT = "index lags 50 ms (live)"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "index lags 50 ms, track_inflight": (CacheAwarePolicy, {"track_inflight": True}),
    "index lags 10 ms": (CacheAwarePolicy, {}),
    "index lags 10 ms, track_inflight": (CacheAwarePolicy, {"track_inflight": True}),
    "fresh index": (CacheAwarePolicy, {}),
    "fresh index, track_inflight": (CacheAwarePolicy, {"track_inflight": True}),
}
REPLAYS = {
    DEFAULT: Lag50,
    "index lags 50 ms, track_inflight": Lag50,
    "index lags 10 ms": Lag10,
    "index lags 10 ms, track_inflight": Lag10,
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.index_lag", __doc__, argv, VARIANTS, DEFAULT, "index_lag",
                        "cache_aware with the index lagging the caches", REPLAYS)


if __name__ == "__main__":
    sys.exit(main())
