"""One simulated replica: a real ``KVStore`` (metadata only), a FIFO admission queue and
``lanes`` prefill workers.

Invariants:
    * A request holds its whole block table (prompt blocks plus room for its output) from
      admission to finish, so running requests' blocks are pinned and decode never runs
      out of blocks.
    * Admission is FIFO: when the head of the queue does not fit, later requests wait
      (no overtaking), unless nothing is running, in which case the head can never fit
      and is rejected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from unicache.replica.kv.store import KVStore
from unicache.sim.prepare import SimRequest


@dataclass(slots=True)
class SimReplica:
    replica_id: str
    store: KVStore
    lanes: int = 1
    busy_lanes: int = 0
    running: int = 0  # admitted, not finished (prefilling or decoding)
    waiting: deque[SimRequest] = field(default_factory=deque)
    queued_prefill_tokens: int = 0  # prompt tokens of requests waiting or being prefilled (no first token yet)
    computed_prefill_tokens: int = 0  # uncached prompt tokens computed so far
    in_flight: int = 0  # routed here, not finished
    flush_phase_s: float = 0.0  # this replica's publisher flushes at (k x period) + this
    unpublished: deque[tuple[float, list]] = field(default_factory=deque)  # (flushed at, store events), in order
