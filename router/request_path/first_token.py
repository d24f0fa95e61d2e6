"""First-token timeouts derived from each replica's measured time to first token.

A replica that sends nothing for longer than its timeout is treated as stalled: the
router cancels the attempt and retries elsewhere (``unicache.router.request_path.core``). The timeout
follows what the replica normally takes, so a frozen replica costs its waiting requests
seconds, not the fixed ceiling.

Estimator (TCP's retransmission timer, RFC 6298, applied to time to first token): per
replica an exponentially weighted mean ``m`` and mean deviation ``d`` of the attempt's
time to first message (gain 1/8 and 1/4); the timeout is::

    clamp(multiplier * (m + 4 d) * backoff, floor_s, ceiling_s)

``backoff`` doubles each time a stall quarantines the replica (``timed_out``; once per
stall, however many requests it caught) and returns to 1 with its next measured first
token (Karn's rule: a timed-out attempt is never a sample, so a
replica that is genuinely slower than its history still gets served, with longer waits).
Until a replica has ``min_samples`` samples it uses the estimate over all replicas, and
until that has ``min_samples`` the ceiling.

A stall is *silence*: the router counts the timeout from the later of the attempt's
start and the replica's last message on any stream (``ReplicaStream.first``), so a
replica that is busy streaming to others (a burst queues requests behind each other) is
not taken for stalled; a frozen one is silent on every stream. The ceiling bounds the
wait in any case.

Invariants:
    * ``timeout_s`` is always within [floor_s, ceiling_s] (floor_s is capped at ceiling_s).
    * Only successful first messages are samples; per-replica state is dropped by
      ``forget`` (the replica left), so memory is bounded by the live replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

_GAIN_MEAN = 1 / 8
_GAIN_DEV = 1 / 4
_MAX_BACKOFF = 64.0


@dataclass(slots=True)
class TtftEstimate:
    """Running mean and mean deviation of time-to-first-token samples (seconds)."""

    mean: float = 0.0
    dev: float = 0.0
    samples: int = 0
    backoff: float = 1.0

    def add(self, ttft_s: float) -> None:
        if self.samples == 0:
            self.mean, self.dev = ttft_s, ttft_s / 2
        else:
            self.dev += _GAIN_DEV * (abs(ttft_s - self.mean) - self.dev)
            self.mean += _GAIN_MEAN * (ttft_s - self.mean)
        self.samples += 1
        self.backoff = 1.0

    @property
    def upper(self) -> float:
        """The estimate's high end, ``mean + 4 dev``."""
        return self.mean + 4 * self.dev


class FirstTokenTimeout:
    """Per-replica first-token timeouts.

    Args:
        ceiling_s: the most a replica may take to its first message (default 60 s); also
            the timeout while nothing has been measured.
        floor_s: the least (default 5 s): a fast replica's estimate is tiny, and a long
            prefill or a short queue must not count as a stall.
        multiplier: headroom over the estimate's high end (default 3).
        min_samples: samples before a replica's own estimate is used (default 5).
    """

    def __init__(self, ceiling_s: float = 60.0, floor_s: float = 5.0, multiplier: float = 3.0, min_samples: int = 5):
        if ceiling_s <= 0 or floor_s < 0 or multiplier <= 0 or min_samples < 1:
            raise ValueError("first-token timeout: ceiling_s, multiplier and min_samples must be positive, floor_s >= 0")
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)
        self.multiplier = multiplier
        self.min_samples = min_samples
        self._all = TtftEstimate()
        self._per: dict[str, TtftEstimate] = {}

    def observe(self, replica_id: str, ttft_s: float) -> None:
        """A first message arrived ``ttft_s`` after the attempt started."""
        est = self._per.get(replica_id)
        if est is None:
            est = self._per[replica_id] = TtftEstimate()
        est.add(ttft_s)
        self._all.add(ttft_s)

    def timed_out(self, replica_id: str) -> None:
        """A stall at the replica quarantined it: double its next timeout (bounded)."""
        est = self._per.get(replica_id)
        if est is None:
            est = self._per[replica_id] = TtftEstimate()
        est.backoff = min(est.backoff * 2, _MAX_BACKOFF)

    def timeout_s(self, replica_id: str) -> float:
        """The current first-token timeout of ``replica_id``."""
        own = self._per.get(replica_id)
        backoff = own.backoff if own is not None else 1.0
        if own is not None and own.samples >= self.min_samples:
            est = own
        elif self._all.samples >= self.min_samples:
            est = self._all
        else:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.multiplier * est.upper * backoff))

    def estimate(self, replica_id: str) -> TtftEstimate | None:
        return self._per.get(replica_id)

    def forget(self, replica_id: str) -> None:
        self._per.pop(replica_id, None)
