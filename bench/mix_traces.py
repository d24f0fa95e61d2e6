"""Generated-mix traces for the bench scripts: one definition of "seed -> prepared trace".

The trace is written with ``write_trace`` and read back with ``read_trace``, so a script
replays it exactly as ``unicache sim`` reads a ``unicache gen-workload`` file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from unicache.sim.prepare import PreparedTrace, prepare
from unicache.sim.runner import capacities_from_fracs
from unicache.sim.workload import WorkloadConfig, generate
from unicache.trace import TraceRequest, read_trace, write_trace


def mix_requests(seed: int, duration: float = 1200.0, block_size: int = 16) -> list[TraceRequest]:
    """The mix of ``seed`` (``gen-workload`` defaults otherwise) as a trace file gives it:
    written and read back, not yet hashed or classified."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"mix{seed}.jsonl"
        write_trace(path, generate(WorkloadConfig(seed=seed, duration=duration, block_size=block_size)))
        return read_trace(path)


def prepared_mix(seed: int, duration: float = 1200.0, block_size: int = 16,
                 capacity_frac: float = 0.01) -> tuple[PreparedTrace, int]:
    """The mix of ``seed`` (``gen-workload`` defaults otherwise), hashed and classified,
    and ``capacity_frac`` of its unique blocks (the per-replica capacity)."""
    trace = prepare(mix_requests(seed, duration, block_size), block_size)
    return trace, capacities_from_fracs([capacity_frac], trace.unique_blocks)[0]
