"""Which of ``cache_aware``'s terms costs it on Mooncake at a larger KV capacity?

At 5% of unique blocks per replica (the defaults were tuned at 2%), ``cache_aware``'s
shipped default falls behind sglang + unicache on the Mooncake report slice: goodput
0.981x / 0.977x and token hits -1.81 / -3.00 points at 4 / 8 replicas
(``bench.studies.capacity_shift``). Each term that trades locality for spreading is a
suspect: the churn term (spreads new prefixes), fit-first (moves a request off a replica
without room for it), the session footprint term, and the TTFT admission factor (how far
a holder's queue may delay a request before it goes elsewhere). So is the rest of the
cost, one setting at a time: admission 1.5, no eviction discount, whole queues instead of
their uncached share, queues not divided by the lanes, half and twice the load weight, no
session stickiness, no template homes.

This study replays the shipped default and each of those turned off (admission: factor 3
instead of 2) against sglang + unicache at ``--capacity-frac`` (default 0.05) on tuning
traces only (``bench.studies.routing_admission``'s; by default the Mooncake tuning slices
0-1, ``--families`` for more). A diagnosis, not a pick: what it finds is to be chosen on
every family's tuning traces and at the tuned capacity too before it changes a default.

Writes ``capacity_terms.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.capacity_terms [--capacity-frac 0.05] [--families mooncake]
        [--variants "load weight 0.5,template homes off"]
"""

from __future__ import annotations

import sys

from bench.studies.variant_study import run_variants
from unicache.router.routing.cache_aware import CacheAwarePolicy

DEFAULT = "shipped"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "churn off": (CacheAwarePolicy, {"churn_weight": 0.0}),
    "fit-first off": (CacheAwarePolicy, {"fit_first": False}),
    "footprint off": (CacheAwarePolicy, {"footprint_weight": 0.0}),
    "admission 3.0": (CacheAwarePolicy, {"admission_factor": 3.0}),
    "admission 1.5": (CacheAwarePolicy, {"admission_factor": 1.5}),
    "eviction discount off": (CacheAwarePolicy, {"evict_weight": 0.0}),
    "queue share off": (CacheAwarePolicy, {"queue_share": False}),
    "whole queue (not per lane)": (CacheAwarePolicy, {"queue_per_lane": False}),
    "load weight 0.5": (CacheAwarePolicy, {"load_weight": 0.5}),
    "load weight 2": (CacheAwarePolicy, {"load_weight": 2.0}),
    "session stickiness off": (CacheAwarePolicy, {"session_sticky": False}),
    "template homes off": (CacheAwarePolicy, {"template_trust": 0.0}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.capacity_terms", __doc__, argv, VARIANTS, DEFAULT, "capacity_terms",
                        "cache_aware's terms at a larger KV capacity",
                        defaults={"capacity_frac": 0.05, "families": "mooncake"}, selectable=True)


if __name__ == "__main__":
    sys.exit(main())
