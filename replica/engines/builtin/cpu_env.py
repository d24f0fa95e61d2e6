"""Process environment a CPU engine wants, applied before torch is imported.

NOTE: with OpenMP's default (ACTIVE) wait policy, idle torch threads spin; on a machine
whose cores are shared (several replicas, the router, Redis) the spinning threads starve
the others and small matmuls ran 10-40x slower in bench/engine_bench.py. PASSIVE lets
them sleep. It only takes effect if set before torch loads, so entry points call this
first; an explicit setting by the user always wins.
"""

from __future__ import annotations

import os


def prefer_passive_omp_wait() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
