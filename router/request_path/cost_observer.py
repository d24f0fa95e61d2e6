"""What the request path tells the cost model: each request's TTFT with its uncached
prompt tokens and the load it met at dispatch, its inter-token times, and how far the
model's TTFT prediction was off.

``RouterCore`` calls, per attempt: ``dispatched`` (the replica's load as the policy saw
it, before this request is counted), ``first_token``, ``message`` (every streamed
message: tokens and the final usage) and ``finished`` (always, in a finally). At
``finished`` a request that had its first token and a usage gives one TTFT observation
(``CostModel.observe_ttft``: uncached = prompt less cached tokens from usage, queued =
the uncached tokens queued ahead per prefill lane, outstanding = the requests there
at dispatch) and, when it streamed tokens after the first, one inter-token observation
(mean seconds per token against the batch it joined: running at dispatch + 1). At
``first_token`` the TTFT the model predicted at dispatch is scored against the measured
one (``CostModel.observe_error`` and the ``on_error`` callback: the router's metric).

Invariant: at most ``max_tracked`` requests are tracked (oldest dropped first), each
O(1) per call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest
from unicache.router.routing.cost_model import CostModel


@dataclass(slots=True)
class _Tracked:
    replica_id: str
    dispatched_at: float
    queued: float  # uncached tokens queued ahead, per lane
    outstanding: int
    running: int
    predicted_s: float
    ttft_s: float = -1.0
    first_at: float = 0.0
    last_at: float = 0.0
    tokens_after_first: int = 0
    messages: int = 0
    uncached: int = -1  # from usage


def uncached_tokens(request: RoutingRequest, decision: RouteDecision) -> int:
    """The prompt tokens of ``request`` that ``decision``'s backend has not cached."""
    return max(0, request.num_prompt_tokens - decision.matched_blocks * request.block_size)


class CostObserver:
    """Feeds ``model`` from the request path (module docstring).

    Args:
        model: the cost model the policy reads.
        prefill_lanes: what a replica's queue is divided by (``CacheAwareConfig.prefill_lanes``).
        queue_shares: the policy's uncached share of each replica's queue (None: whole prompts).
        on_error: called with (replica id, predicted s, measured s) per first token.
        clock: seconds (default ``time.perf_counter``).
        max_tracked: bound on the requests tracked at once.
    """

    def __init__(self, model: CostModel, prefill_lanes: int = 4,
                 queue_shares: Callable[[], dict[str, float] | None] | None = None,
                 on_error: Callable[[str, float, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, max_tracked: int = 100_000):
        self.model = model
        self.prefill_lanes = max(1, prefill_lanes)
        self.queue_shares = queue_shares
        self.on_error = on_error
        self.clock = clock
        self.max_tracked = max_tracked
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tracked)

    def features(self, rid: str, load: ReplicaLoad | None) -> tuple[float, int, int]:
        """(queued, outstanding, running) of a request dispatched to ``rid`` now, whose
        load before counting it is ``load``: the terms of ``Costs.ttft_s`` beside its
        uncached tokens (module docstring)."""
        if load is None:
            return 0.0, 0, 0
        share = 1.0
        if self.queue_shares is not None and load.queued_prefill_tokens:
            share = (self.queue_shares() or {}).get(rid, 1.0)
        return (load.queued_prefill_tokens * share / self.prefill_lanes,
                max(load.in_flight, load.running + load.waiting), load.running)

    def predicted_ttft_s(self, rid: str, load: ReplicaLoad | None, uncached: int) -> tuple[float, bool]:
        """The TTFT ``rid``'s costs predict for a request of ``uncached`` prompt tokens
        dispatched there now, and whether those costs are fitted (not the prior)."""
        queued, outstanding, _ = self.features(rid, load)
        costs = self.model.costs(rid)
        return costs.ttft_s(uncached, queued, outstanding), costs.fitted

    def dispatched(self, request: RoutingRequest, decision: RouteDecision, load: ReplicaLoad | None) -> None:
        """``request`` is sent to ``decision.replica_id``, whose load (before counting this
        request) is ``load``."""
        rid = decision.replica_id
        queued, outstanding, running = self.features(rid, load)
        predicted = self.model.costs(rid).ttft_s(uncached_tokens(request, decision), queued, outstanding)
        tracked = self._tracked
        tracked.pop(request.request_id, None)
        tracked[request.request_id] = _Tracked(rid, self.clock(), queued, outstanding, running, predicted)
        while len(tracked) > self.max_tracked:
            tracked.popitem(last=False)

    def first_token(self, request_id: str) -> None:
        t = self._tracked.get(request_id)
        if t is None:
            return
        now = self.clock()
        t.first_at = t.last_at = now
        t.ttft_s = now - t.dispatched_at
        self.model.observe_error(t.replica_id, t.predicted_s, t.ttft_s)
        if self.on_error is not None:
            self.on_error(t.replica_id, t.predicted_s, t.ttft_s)

    def message(self, request_id: str, msg) -> None:
        """A streamed ``GenerateResponse`` (its tokens; its usage on the last one)."""
        t = self._tracked.get(request_id)
        if t is None or msg.index != 0:
            return
        t.messages += 1
        n = len(msg.token_ids)
        if n and t.ttft_s >= 0 and t.messages > 1:  # the first message's own tokens are the TTFT's
            t.tokens_after_first += n
            t.last_at = self.clock()
        if msg.HasField("usage"):
            u = msg.usage
            t.uncached = max(0, u.prompt_tokens - u.cached_tokens)

    def usage(self, request_id: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int = 0) -> None:
        """The final usage of an answer relayed as bytes (vLLM's own stream), which never
        passes ``message``: its uncached prompt tokens (no inter-token times)."""
        t = self._tracked.get(request_id)
        if t is not None:
            t.uncached = max(0, prompt_tokens - cached_tokens)

    def finished(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None or t.ttft_s < 0:
            return
        model = self.model
        if t.uncached >= 0:
            model.observe_ttft(t.replica_id, t.ttft_s, t.uncached, t.queued, t.outstanding)
        if t.tokens_after_first > 0 and t.last_at > t.first_at:
            model.observe_itl(t.replica_id, (t.last_at - t.first_at) / t.tokens_after_first, t.running + 1)
