"""How many prefill lanes should ``cache_aware`` count on an engine that steps?

``cache_aware`` weighs a replica's prefill queue over ``prefill_lanes`` (default 4, the
simulator's lanes model: 4 independent prefill lanes per replica), in its TTFT admission
estimate (uncached prompt tokens + queue / lanes) and in its cost's load term. vLLM and
the built-in engine run one step loop instead: every request's prefill shares one token
budget, so a new request waits for the whole queue ahead of it at the engine's full
speed, and the estimate that matches is uncached + queue (1 lane). The step service model
(``unicache.sim.steps.StepReplay``: one engine per replica as fast as the 4 lanes together)
replays that discipline.

This study replays ``cache_aware`` with ``prefill_lanes`` 4 (shipped), 2 and 1, and sglang
+ unicache, all on the step model, on the suite's tuning traces only
(``bench.studies.routing_admission``'s: 4 points per generated family, Mooncake slices 0-1),
with the step model's SLO rule (3 x the light-load TTFT of a replica already decoding, as
``bench.studies.step_service``), and gives each family's leave-one-family-out pick.

Result (bench/results/step_lanes.md): the shipped 4 is every held-out family's pick at 4
and 8 replicas; 1 lane scores 0.986x / 0.932x its goodput and 2 lanes 0.985x / 0.988x. The
binding resource on the suite is KV memory, not prefill (``bench.studies.kv_admission``),
so weighing the queue 4 times heavier against the request's own uncached tokens gives up
locality that the shorter queue does not pay back. The live router keeps 4 for both engines.

Writes ``step_lanes.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.step_lanes [--workers 2] [--replicas 4,8]
"""

from __future__ import annotations

import functools
import sys

from bench.routing_report import LANES
from bench.studies.variant_study import SGL_UC, run_variants
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.steps import StepReplay, unloaded_ttft_s

DEFAULT = "lanes 4 (shipped)"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "lanes 2": (CacheAwarePolicy, {"prefill_lanes": 2}),
    "lanes 1": (CacheAwarePolicy, {"prefill_lanes": 1}),
}


def main(argv: list[str] | None = None) -> int:
    replays = {label: StepReplay for label in (*VARIANTS, SGL_UC)}
    extra = {"unloaded_ttft_s": functools.partial(unloaded_ttft_s, lanes=LANES, decoding=True)}
    return run_variants("bench.studies.step_lanes", __doc__, argv, VARIANTS, DEFAULT, "step_lanes",
                        "cache_aware's prefill lanes on the step service model", replays=replays,
                        common_extra=extra, held_out=True)


if __name__ == "__main__":
    sys.exit(main())
