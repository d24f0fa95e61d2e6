"""What a replica's published queue should hold while prefills run, and how ``cache_aware``
should weigh it.

Replicas publish ``queued_prefill_tokens``. The vLLM engine counts a request's whole prompt
until its first output; the simulator used to drop a request from the figure when its
prefill batch started, so a replica whose prefill lanes were all busy looked idle: on the
agent tuning trace agent-p1003-s1000 at 4 replicas (u = 1.5) session turns kept at such a
home waited up to 1.1 s while other replicas had idle lanes (TTFT p90 0.209 s against
sglang's 0.064; 0.080 once the simulator published running prefills too). Now the
simulator publishes what the vLLM engine does; but its service model has ``lanes``
parallel prefill lanes, where a running prefill delays a new request only once every lane
is busy, and ``cache_aware``'s cost weighs the queue 1:1 against the request's own
uncached tokens, as if one lane drained it (its TTFT admission estimate divides the queue
by the lanes).

Variants (tuning traces only, ``bench.studies.routing_admission``'s; 4 and 8 replicas),
all but the shipped one with the whole queue in the cost (``queue_per_lane=False``, the
default before this study):

    * ``published until first token``: the simulator as it is (the reference);
    * ``dropped at prefill start (old simulator)``: the simulator's old figure, waiting
      requests only (``StartDropReplay``);
    * ``queue per lane in the cost (shipped)``: the cost's load term counts the queue over
      the prefill lanes, as the admission estimate does (``queue_per_lane``; first run as
      load_weight 0.25 with request_cost_tokens 512, 0.25 * (q + 512 * out) = q / 4 + 128 *
      out, the same costs);
    * ``admission 1.5, no footprint``: the setting the routing report's cross-validation
      over 7 tuning traces picked on the shipped simulator (``af1.5-ch0.5-fp0.0-fit1-qs1``);
    * ``admission 3.0``: a stickier admission.

Result: the old figure scored 1.054x / 1.045x at 4 / 8 replicas, the queue per lane
1.019x / 1.016x (15 / 9 and 16 / 7 traces above / below), admission 1.5 without the
footprint term 0.976x / 0.941x, admission 3.0 0.994x / 0.994x. The routing report's
cross-validation, over 25 tuning traces, then picked the queue per lane for 7 of 7
held-out families, and it ships.

Writes ``prefill_queue.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.prefill_queue [--points 4] [--workers 2]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from bench.studies.variant_study import run_variants
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.replay import Replay

DEFAULT = "published until first token"


class StartDropReplay(Replay):
    """The simulator's old published queue: the whole prompts of waiting requests only (a
    request leaves it when its prefill batch starts)."""

    def _snapshot(self) -> list[ReplicaLoad]:
        loads = super()._snapshot()
        return [replace(load, queued_prefill_tokens=sum(r.prompt_tokens for r in rep.waiting))
                for rep, load in zip(self.replicas, loads)]


WHOLE = {"queue_per_lane": False}
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, WHOLE),
    "dropped at prefill start (old simulator)": (CacheAwarePolicy, WHOLE),
    "queue per lane in the cost (shipped)": (CacheAwarePolicy, {}),
    "admission 1.5, no footprint": (CacheAwarePolicy, {**WHOLE, "admission_factor": 1.5, "footprint_weight": 0.0}),
    "admission 3.0": (CacheAwarePolicy, {**WHOLE, "admission_factor": 3.0}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.prefill_queue", __doc__, argv, VARIANTS, DEFAULT, "prefill_queue",
                        "cache_aware and the replicas' published queue while prefills run",
                        replays={"dropped at prefill start (old simulator)": StartDropReplay})


if __name__ == "__main__":
    sys.exit(main())
