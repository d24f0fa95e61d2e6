"""Run a grid of replays (policies x capacities x routers) over one prepared trace.

Shared by ``unicache sim`` and ``bench/eviction_report.py`` so both measure the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from unicache.sim.prepare import PreparedTrace, future_accesses
from unicache.sim.replay import Replay, ReplayConfig


def capacities_from_fracs(fracs: Sequence[float], unique_blocks: int) -> list[int]:
    """Blocks per capacity fraction of the trace's unique blocks (ValueError if one is 0)."""
    caps = []
    for f in fracs:
        blocks = int(f * unique_blocks)
        if blocks <= 0:
            raise ValueError(f"capacity {f:g} of {unique_blocks} unique blocks is 0 blocks")
        caps.append(blocks)
    return caps


def run_grid(
    trace: PreparedTrace,
    policies: Sequence[str],
    capacities: Sequence[int],
    base: ReplayConfig,
    routers: Sequence[str | None] = (None,),
    pooled: bool = False,
    progress: bool = False,
    on_result: Callable[[dict], None] | None = None,
    rate_scales: Sequence[float] = (1.0,),
    host_capacities: Sequence[int] = (0,),
    replay: Callable[..., Replay] = Replay,
) -> list[dict]:
    """One result record per (policy, capacity, host capacity[, router], rate scale);
    ``pooled`` adds a pooled run. Rate scales vary fastest, so one (policy, capacity,
    router)'s goodput points are adjacent. ``host_capacities`` are host-tier blocks per
    replica (0: none); the host policy is ``base.host_policy``. ``replay`` builds each run
    (``Replay``, the lanes model, or e.g. ``unicache.sim.steps.StepReplay``).

    The opt oracle is built once here (outside the per-policy loop).
    """
    host_opt = base.host_policy == "opt" and any(host_capacities)
    future = future_accesses(trace) if "opt" in policies or host_opt else None
    results = []
    variants: list[ReplayConfig] = []
    for policy in policies:
        for cap in capacities:
            for host in host_capacities:
                for router in routers:
                    variants += [replace(base, policy=policy, capacity_blocks=cap, router=router, pooled=False,
                                         rate_scale=s, host_capacity_blocks=host) for s in rate_scales]
                if pooled and base.replicas > 1:
                    variants += [replace(base, policy=policy, capacity_blocks=cap, router=None, pooled=True,
                                         rate_scale=s, host_capacity_blocks=host) for s in rate_scales]
    for cfg in variants:
        rec = replay(trace, cfg, future=future, progress=progress).run()
        results.append(rec)
        if on_result is not None:
            on_result(rec)
    return results
