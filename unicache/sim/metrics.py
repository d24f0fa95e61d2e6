"""What one replay measured, and the result record written to the JSON report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplayCounters:
    """Counters a replay fills in; ``result`` turns them into the report record."""

    hit_blocks: int = 0  # GPU and host hits
    host_hit_blocks: int = 0
    hit_tokens: int = 0
    input_tokens: int = 0
    rejected: int = 0
    task_hits: dict[str, int] = field(default_factory=dict)
    task_accesses: dict[str, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)

    def count_task(self, task: str, hits: int, accesses: int) -> None:
        self.task_hits[task] = self.task_hits.get(task, 0) + hits
        self.task_accesses[task] = self.task_accesses.get(task, 0) + accesses


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def result_record(
    counters: ReplayCounters,
    *,
    policy: str,
    capacity_blocks: int,
    block_accesses: int,
    evictions: int,
    elapsed_s: float,
    cpu_s: float,
    rate_scale: float = 1.0,
    demotions: int = 0,
    host_capacity_blocks: int = 0,
    host_policy: str | None = None,
) -> dict:
    """The per-(policy, capacity) entry of the ``results`` list (see the CLI contract).

    ``accesses_per_s`` divides the trace's block accesses by the replay's *CPU* seconds
    (the replay is single-threaded, so this is per core and does not drop when other
    jobs share the machine); ``elapsed_s`` is wall time. ``rate_scale`` is the factor the
    trace's arrival times were divided by (1: as recorded). TTFT percentiles are nearest
    rank over every admitted request (rejected requests have no first token).
    ``block_hit_ratio`` counts every block not computed, GPU hits plus host hits
    (promotions), split as ``gpu_hit_ratio`` and ``host_hit_ratio``.
    """
    ttfts = counters.ttfts
    return {
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "block_hit_ratio": counters.hit_blocks / block_accesses if block_accesses else 0.0,
        "gpu_hit_ratio": (counters.hit_blocks - counters.host_hit_blocks) / block_accesses if block_accesses else 0.0,
        "host_hit_ratio": counters.host_hit_blocks / block_accesses if block_accesses else 0.0,
        "token_hit_ratio": counters.hit_tokens / counters.input_tokens if counters.input_tokens else 0.0,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50.0),
        "ttft_p90_s": percentile(ttfts, 90.0),
        "ttft_p99_s": percentile(ttfts, 99.0),
        "rate_scale": rate_scale,
        "per_task": {
            task: counters.task_hits.get(task, 0) / n
            for task, n in sorted(counters.task_accesses.items())
            if n
        },
        "hit_blocks": counters.hit_blocks,
        "host_hit_blocks": counters.host_hit_blocks,
        "evictions": evictions,
        "demotions": demotions,
        "host_capacity_blocks": host_capacity_blocks,
        "host_policy": host_policy,
        "rejected": counters.rejected,
        "elapsed_s": elapsed_s,
        "cpu_s": cpu_s,
        "accesses_per_s": block_accesses / cpu_s if cpu_s > 0 else math.inf,
    }
