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

A backend that stops answering gives no observation, so the observer also watches the
requests still waiting for their first token: at most every ``overdue_every_s``, at a
dispatch, each backend's largest log(waited / predicted) beyond
``CostModel.overdue_threshold`` becomes its overdue factor (``CostModel.set_overdue``),
and the next decisions price it so. An answer, or the end of the request, takes it off
at the next look. The time between two looks counts, for each backend the earlier look
priced overdue, as time priced overdue (the ``on_overdue`` callback: the router's
counter), so an operator sees how often the pricing acted.
Only a prediction in the model's fitted seconds is watched, and only a streamed answer.
An unstreamed answer comes whole at the end: its wait is the whole generation, not a
TTFT. It is not watched and its prediction is not scored; its TTFT observation is the
whole wait less the decode of its other completion tokens at the model's inter-token
time (``Costs.itl_s``), when that leaves a positive time.

Invariant: at most ``max_tracked`` requests are tracked (oldest dropped first), each
O(1) per call but the overdue look, O(requests waiting for a first token) at most every
``overdue_every_s``.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest, uncached_tokens
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
    streamed: bool = True  # False: the answer came whole, and first_at is its end
    completion_tokens: int = 0  # from usage


class CostObserver:
    """Feeds ``model`` from the request path (module docstring).

    Args:
        model: the cost model the policy reads.
        prefill_lanes: what a replica's queue is divided by (``CacheAwareConfig.prefill_lanes``).
        queue_shares: the policy's uncached share of each replica's queue (None: whole prompts).
        on_error: called with (replica id, predicted s, measured s) per first token.
        clock: seconds (default ``time.perf_counter``).
        max_tracked: bound on the requests tracked at once.
        overdue_every_s: the least time between two looks at the waiting requests.
        on_overdue: called with (replica id, seconds) for each backend priced overdue
            since the previous look, at each look.
    """

    def __init__(self, model: CostModel, prefill_lanes: int = 4,
                 queue_shares: Callable[[], dict[str, float] | None] | None = None,
                 on_error: Callable[[str, float, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, max_tracked: int = 100_000,
                 overdue_every_s: float = 0.1, on_overdue: Callable[[str, float], None] | None = None):
        self.model = model
        self.prefill_lanes = max(1, prefill_lanes)
        self.queue_shares = queue_shares
        self.on_error = on_error
        self.clock = clock
        self.max_tracked = max_tracked
        self.overdue_every_s = overdue_every_s
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()
        # the tracked requests waiting for a first token with a prediction in seconds
        self._waiting: dict[str, _Tracked] = {}
        self._overdue_at = -math.inf
        self.on_overdue = on_overdue
        self._priced_overdue: tuple[str, ...] = ()  # the backends the last look priced overdue
        self._looked_at = 0.0

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

    def dispatched(self, request: RoutingRequest, decision: RouteDecision, load: ReplicaLoad | None,
                   streamed: bool = True) -> None:
        """``request`` is sent to ``decision.replica_id``, whose load (before counting this
        request) is ``load``; ``streamed``: its first token is seen when it comes (False:
        the answer comes whole, module docstring)."""
        now = self.clock()
        if now - self._overdue_at >= self.overdue_every_s:
            self._overdue_at = now
            self.refresh_overdue(now)
        rid = decision.replica_id
        model = self.model
        queued, outstanding, running = self.features(rid, load)
        predicted = model.costs(rid).ttft_s(uncached_tokens(request, decision), queued, outstanding)
        tracked, rq = self._tracked, request.request_id
        if tracked.pop(rq, None) is not None:
            self._waiting.pop(rq, None)
        t = tracked[rq] = _Tracked(rid, now, queued, outstanding, running, predicted, streamed=streamed)
        if streamed and predicted > 0.0 and not model.uniform:
            self._waiting[rq] = t
        while len(tracked) > self.max_tracked:
            self._waiting.pop(tracked.popitem(last=False)[0], None)

    def refresh_overdue(self, now: float) -> None:
        """Each backend's overdue factor from the requests waiting for their first token
        at ``now`` (module docstring); the time since the previous look counted for the
        backends it priced overdue."""
        if self._priced_overdue and self.on_overdue is not None:
            since = now - self._looked_at
            for rid in self._priced_overdue:
                self.on_overdue(rid, since)
        self._looked_at = now
        threshold = self.model.overdue_threshold()
        factors: dict[str, float] = {}
        if threshold is not None:
            log = math.log
            for t in self._waiting.values():
                excess = log((now - t.dispatched_at) / t.predicted_s) - threshold if now > t.dispatched_at else 0.0
                if excess > factors.get(t.replica_id, 0.0):  # only a positive excess counts
                    factors[t.replica_id] = excess
        self.model.set_overdue({rid: math.exp(x) for rid, x in factors.items()})
        self._priced_overdue = tuple(rid for rid in factors if self.model.overdue(rid) > 1.0)

    def first_token(self, request_id: str) -> None:
        t = self._tracked.get(request_id)
        if t is None:
            return
        self._waiting.pop(request_id, None)
        now = self.clock()
        t.first_at = t.last_at = now
        t.ttft_s = now - t.dispatched_at
        if not t.streamed:
            return
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
            t.completion_tokens = completion_tokens

    def finished(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        t = self._tracked.pop(request_id, None)
        if t is None or t.ttft_s < 0:
            return
        model = self.model
        ttft = t.ttft_s
        if not t.streamed and t.completion_tokens > 1:
            ttft -= (t.completion_tokens - 1) * model.costs(t.replica_id).itl_s(t.running + 1)
        if t.uncached >= 0 and ttft > 0.0:
            model.observe_ttft(t.replica_id, ttft, t.uncached, t.queued, t.outstanding)
        if t.tokens_after_first > 0 and t.last_at > t.first_at:
            model.observe_itl(t.replica_id, (t.last_at - t.first_at) / t.tokens_after_first, t.running + 1)
