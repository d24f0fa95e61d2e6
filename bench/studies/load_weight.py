"""Is ``cache_aware``'s load weight better at 0.5 than the shipped 1.0? Decided on tuning
points no default was chosen on.

The routing report's cross-validation with load weight 0.5 among the candidates
(``bench.routing_report --load-weights 1.0,0.5 --cv-only``) picks the shipped setting at
load weight 0.5 for every held-out family, by about 1% of mean log goodput on the 26
tuning traces (tuning points 0-3 of each generated family, Mooncake's tuning slice). Is
that more than those traces' noise? This study replays both settings, and sglang +
unicache, on *other* tuning points of the six generated families (by default points 4-11,
``--first-point 4 --points 8``: tuning points all, disjoint from the report's points and
from every point a default was chosen on; Mooncake has no unused tuning slice and is
left out), at the tuned capacity (2% of unique blocks) and 4 and 8 replicas.

The rule, fixed before the run: the shipped load weight becomes 0.5 if the paired 95%
bootstrap interval of goodput (0.5 / 1.0, geometric mean over the traces,
``variant_study.bootstrap_ci95``) lies above 1.0 at both 4 and 8 replicas; otherwise it
stays 1.0 and the cross-validation's gain is read as noise.

Writes ``load_weight.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.load_weight [--first-point 4] [--points 8]
"""

from __future__ import annotations

import sys

from bench.studies.routing_admission import UNUSED_TUNING_POINTS
from bench.studies.variant_study import run_variants
from unicache.router.routing.cache_aware import CacheAwarePolicy

DEFAULT = "shipped (load weight 1.0)"
VARIANTS = {
    DEFAULT: (CacheAwarePolicy, {}),
    "load weight 0.5": (CacheAwarePolicy, {"load_weight": 0.5}),
}


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.load_weight", __doc__, argv, VARIANTS, DEFAULT, "load_weight",
                        "cache_aware's load weight on unused tuning points",
                        defaults=UNUSED_TUNING_POINTS)


if __name__ == "__main__":
    sys.exit(main())
