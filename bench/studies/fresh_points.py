"""Does the routing report's cross-validation pick the same default on tuning points it
never saw?

``bench.routing_report`` chooses ``cache_aware``'s admission factor, footprint weight and
queue per lane (its 12 ``CANDIDATES``) by mean log goodput over the suite's 25 tuning
traces at 4 replicas; the all-family pick, af2.0-fp0.5-ql1, is the shipped default. This
study replays the 12 candidates and sglang + unicache on *other* tuning points of the six
generated families (by default points 4-11, ``--first-point 4 --points 8``: tuning points
all, disjoint from the report's and from the ones the defaults were chosen on; Mooncake has
no unused tuning slice) at the tuned capacity and 4 replicas, and reports every candidate
against the shipped one (paired 95% bootstrap interval), each family's leave-one-family-out
pick and the all-family pick there.

A check of the choice, not a new one: a candidate would replace the shipped default only
if its interval against it lay above 1.0 (the rule ``bench.studies.load_weight`` fixed
for the load weight).

Writes ``fresh_points.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced; about 20 min):
    nice -n 10 .venv/bin/python -m bench.studies.fresh_points [--first-point 4] [--points 8] [--replicas 4]
        [--variants af1.5-fp0.5-ql1 --replicas 4,8 --out-dir DIR]   (one candidate against the shipped one)
"""

from __future__ import annotations

import sys

from bench.routing_report import CANDIDATES, code_default_candidate
from bench.studies.routing_admission import UNUSED_TUNING_POINTS
from bench.studies.variant_study import run_variants
from unicache.router.routing.cache_aware import CacheAwarePolicy


def main(argv: list[str] | None = None) -> int:
    default = code_default_candidate()
    if default is None:
        raise SystemExit("the shipped defaults are none of the routing report's candidates")
    variants = {label: (CacheAwarePolicy, kw) for label, kw in CANDIDATES.items()}
    return run_variants("bench.studies.fresh_points", __doc__, argv, variants, default, "fresh_points",
                        "the routing report's candidates on unused tuning points", held_out=True,
                        defaults={**UNUSED_TUNING_POINTS, "replicas": "4"}, selectable=True)


if __name__ == "__main__":
    sys.exit(main())
