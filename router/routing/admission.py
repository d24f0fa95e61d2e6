"""TTFT admission: which replicas may take a request, judged by its estimated time to first token.

A cache-aware policy wants the replica that holds the request's prefix, but a replica
whose prefill queue is long makes the request wait longer than recomputing the prefix
elsewhere would. A fixed balance rule (outstanding requests within a ratio of the mean)
guards against piling up, but it counts decoding requests, which do not delay a prefill,
and it ignores what the cached prefix saves. This module compares the two things that
make up the wait instead, in prefill tokens (prefill time is close to linear in the
tokens computed):

    est_r = uncached_r + queued_prefill_tokens_r / prefill_lanes
    uncached_r = max(0, N - B * m_r)       m_r: leading blocks the index shows on r

(``queued_prefill_tokens`` is prompt work admitted and not computed yet, whole prompts as
replicas publish it; a caller that knows what share of it is uncached passes that share,
``queue_share[r]``, and the queue counts ``queued_prefill_tokens_r * queue_share[r]``;
a replica runs ``prefill_lanes`` prefill batches at once.) A replica is *admissible* when

    est_r <= factor * min_r' est_r'

so the cache-best replica keeps the request unless its queueing delay makes the
estimated TTFT more than ``factor`` times the best alternative's. The least-estimate
replica is always admissible, so the set is never empty.

Invariants:
    * ``admissible`` keeps the input order and is never empty for a non-empty input.
    * The estimate depends only on the request's length, the index's match, the
      replica's published load and the caller's queue share (the live router and the
      simulator see the same inputs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unicache.router.routing.base import ReplicaLoad


@dataclass(slots=True, frozen=True)
class TTFTAdmission:
    """The TTFT admission rule (module docstring).

    Args:
        factor: a replica is admissible while its estimated TTFT is at most this times
            the lowest estimate (>= 1).
        prefill_lanes: prefill batches a replica runs at once (the queue drains this
            many times faster than one request's prefill; >= 1).
    """

    factor: float = 2.0
    prefill_lanes: int = 4

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError("the admission factor must be >= 1")
        if self.prefill_lanes < 1:
            raise ValueError("prefill_lanes must be >= 1")

    def estimate(self, num_prompt_tokens: int, block_size: int, matched_blocks: int, load: ReplicaLoad,
                 queue_share: float = 1.0) -> float:
        """Estimated TTFT on ``load``'s replica, in prefill tokens."""
        uncached = max(0, num_prompt_tokens - block_size * matched_blocks)
        return uncached + load.queued_prefill_tokens * queue_share / self.prefill_lanes

    def admissible(self, replicas: Sequence[ReplicaLoad], num_prompt_tokens: int, block_size: int,
                   matches: Mapping[str, int], queue_share: Mapping[str, float] | None = None) -> list[ReplicaLoad]:
        """The replicas whose estimate is within ``factor`` of the best (``matches``: the
        index's leading-block match per replica; a replica left out matches 0;
        ``queue_share``: the uncached share of a replica's queue, 1 where left out)."""
        # NOTE: ``estimate`` inlined (the router runs this per request over every replica)
        lanes, get = self.prefill_lanes, matches.get
        if queue_share:
            share = queue_share.get
            est = [max(0, num_prompt_tokens - block_size * get(r.replica_id, 0))
                   + r.queued_prefill_tokens * share(r.replica_id, 1.0) / lanes for r in replicas]
        else:
            est = [max(0, num_prompt_tokens - block_size * get(r.replica_id, 0)) + r.queued_prefill_tokens / lanes
                   for r in replicas]
        cap = self.factor * min(est)
        return [r for r, e in zip(replicas, est) if e <= cap]
