"""How fast each backend starts the requests it has queued: the measured side of the
overload guard's predicted wait (router/request_path/overload.py).

A backend serving its queue in order starts a queued request each time a running one
ends, so a request joining behind ``k`` queued ones waits about ``k / rate``, where
``rate`` is how many requests per second it starts *while it has a queue* (its service
rate; starts at an idle backend only show the arrival rate, and are not counted). The
router sees a start as a first token. ``DrainRates`` keeps, per backend, the times of the
last ``window`` first tokens that arrived while that backend had requests queued, and
gives ``(n - 1) / span`` over them once ``min_starts`` are in.

This is a queueing estimate, not a fit: where the backend batches, the time a queued
request waits is not a line through lightly loaded observations (it is about zero until
the batch is full, then grows with the queue), which the robust cost fit
(router/routing/cost_model.py) weighs as outliers. The guard takes the larger of the two.

Invariants: O(1) per start; at most ``window`` times per backend.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from unicache.router.routing.base import ReplicaLoad


def queued_requests(load: ReplicaLoad) -> int:
    """What ``load``'s backend has accepted and not started: ``max(waiting, in_flight -
    running)`` (a backend that reports no running count counts all it has in flight)."""
    return max(load.waiting, load.in_flight - load.running, 0)


class DrainRates:
    """Per backend, requests started per second while it had a queue (module docstring).

    Args:
        window: starts kept per backend (default 32).
        min_starts: starts before a rate is given (default 8).
        clock: seconds (default ``time.monotonic``).
    """

    def __init__(self, window: int = 32, min_starts: int = 8, clock: Callable[[], float] = time.monotonic):
        if not 2 <= min_starts <= window:
            raise ValueError("DrainRates needs 2 <= min_starts <= window")
        self.window = window
        self.min_starts = min_starts
        self.clock = clock
        self._starts: dict[str, deque[float]] = {}

    def started(self, rid: str, queued: int) -> None:
        """A request's first token from ``rid``, which had ``queued`` requests waiting then."""
        if queued <= 0:
            return
        starts = self._starts.get(rid)
        if starts is None:
            starts = self._starts[rid] = deque(maxlen=self.window)
        starts.append(self.clock())

    def rate(self, rid: str) -> float | None:
        """Requests ``rid`` starts per second while queued (None: too few starts seen)."""
        starts = self._starts.get(rid)
        if starts is None or len(starts) < self.min_starts:
            return None
        span = starts[-1] - starts[0]
        return (len(starts) - 1) / span if span > 0 else None

    def wait_s(self, rid: str, queued: int) -> float:
        """Seconds until ``queued`` requests ahead at ``rid`` have started (0 when its
        rate is not known yet, or nothing is queued)."""
        if queued <= 0:
            return 0.0
        rate = self.rate(rid)
        return queued / rate if rate else 0.0

    def forget(self, rid: str) -> None:
        self._starts.pop(rid, None)
