"""How fast each backend starts the requests it has queued: the measured side of the
overload guard's predicted wait (router/request_path/overload.py).

A backend serving its queue in order starts a queued request each time a running one
ends, so a request joining behind ``k`` unstarted ones waits about ``k / rate``, where
``rate`` is how many requests per second it starts *while it has a queue* (its service
rate). The router sees a start as a first token, and counts its own requests at each
backend that have none yet (``unstarted``: exact, where a backend's reported running and
waiting counts are a poll old). The time from one start to the next is a service interval
only when the first left requests waiting: then the backend cannot have been idle in
between. ``DrainRates`` keeps the last ``window`` such intervals per backend and gives
their count over their sum once ``min_intervals`` are in; an idle gap never enters it.

This is a queueing estimate, not a fit: where the backend batches, the time a queued
request waits is not a line through lightly loaded observations (it is about zero until
the batch is full, then grows with the queue), which the robust cost fit
(router/routing/cost_model.py) weighs as outliers. The guard takes the larger of the two.

Invariants: O(1) per call; at most ``window`` intervals per backend; ``unstarted(r)`` is
never negative (every ``dispatched`` is matched by one ``started`` or ``abandoned``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from unicache.router.routing.base import ReplicaLoad


@dataclass(slots=True)
class _Backend:
    intervals: deque = field(default_factory=deque)
    total_s: float = 0.0  # sum of ``intervals``
    unstarted: int = 0
    last_start: float | None = None  # the last start that left requests waiting


class DrainRates:
    """Per backend, requests started per second while it had a queue (module docstring).

    Args:
        window: service intervals kept per backend (default 32).
        min_intervals: intervals before a rate is given (default 8).
        clock: seconds (default ``time.monotonic``).
    """

    def __init__(self, window: int = 32, min_intervals: int = 8, clock: Callable[[], float] = time.monotonic):
        if not 1 <= min_intervals <= window:
            raise ValueError("DrainRates needs 1 <= min_intervals <= window")
        self.window = window
        self.min_intervals = min_intervals
        self.clock = clock
        self._backends: dict[str, _Backend] = {}

    def _backend(self, rid: str) -> _Backend:
        b = self._backends.get(rid)
        if b is None:
            b = self._backends[rid] = _Backend()
        return b

    def dispatched(self, rid: str) -> None:
        """One of this router's requests was sent to ``rid`` and has no first token yet."""
        self._backend(rid).unstarted += 1

    def abandoned(self, rid: str) -> None:
        """A dispatched request ended before its first token (failed, refused, cancelled)."""
        b = self._backends.get(rid)
        if b is not None and b.unstarted > 0:
            b.unstarted -= 1

    def started(self, rid: str) -> None:
        """A dispatched request's first token from ``rid``."""
        b = self._backend(rid)
        b.unstarted = max(0, b.unstarted - 1)
        now = self.clock()
        if b.last_start is not None:  # the previous start left requests waiting: busy since
            gap = now - b.last_start
            b.intervals.append(gap)
            b.total_s += gap
            if len(b.intervals) > self.window:
                b.total_s -= b.intervals.popleft()
        b.last_start = now if b.unstarted > 0 else None

    def unstarted(self, rid: str) -> int:
        b = self._backends.get(rid)
        return b.unstarted if b is not None else 0

    def rate(self, rid: str) -> float | None:
        """Requests ``rid`` starts per second while queued (None: too few intervals seen)."""
        b = self._backends.get(rid)
        if b is None or len(b.intervals) < self.min_intervals or b.total_s <= 0:
            return None
        return len(b.intervals) / b.total_s

    def wait_s(self, rid: str, queued: int) -> float:
        """Seconds until ``queued`` requests ahead at ``rid`` have started (0 when its
        rate is not known yet, or nothing is queued)."""
        if queued <= 0:
            return 0.0
        rate = self.rate(rid)
        return queued / rate if rate else 0.0

    def queued(self, rid: str, load: ReplicaLoad) -> int:
        """Requests ahead of a new one at ``rid``: this router's unstarted ones there, or
        the backend's reported waiting count (other routers' too) when that is larger."""
        return max(self.unstarted(rid), load.waiting)

    def intervals_s(self, rid: str) -> list[float]:
        """``rid``'s service intervals kept, oldest first."""
        b = self._backends.get(rid)
        return list(b.intervals) if b is not None else []

    def forget(self, rid: str) -> None:
        self._backends.pop(rid, None)
