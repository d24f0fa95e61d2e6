"""Overload admission: per-backend and fleet-wide bounds on queued work, beyond which a new
request is refused at once with a retry hint.

The refusal is HTTP 429 with ``Retry-After`` (gRPC RESOURCE_EXHAUSTED with ``retry-after``
trailing metadata), before any token is computed, instead of a wait until the request's
deadline expires.

Queued work at a backend, from the load the policies see (``ReplicaLoad``: its heartbeat
or ``/metrics``, and the requests routers have in flight there):

* requests: ``max(waiting, in_flight - running)``, what it has accepted and not started
  (a backend that reports no running count counts all it has in flight);
* tokens: ``queued_prefill_tokens``, the prompt tokens of its requests without a first
  token (our replicas report it; for a stock vLLM server, which does not, the router
  counts its own requests': ``ClusterView.prefilled``).

Bounds (``OverloadConfig``; 0 switches a bound off):

* per backend: ``backend_queue`` requests, and ``backend_queue_tokens`` times its KV
  capacity in tokens (``capacity_blocks * block_size``, as it reports it);
* fleet-wide: ``fleet_queue`` requests and ``fleet_queue_tokens`` tokens, each by default
  the sum of the live backends' bounds (none when one of them has none).

A request of ``n`` prompt tokens is refused when no live backend has room (requests below
its bound, and queued tokens plus ``n`` within its token bound), or when the fleet's
queued requests reach its bound, or its queued tokens plus ``n`` pass its token bound. A
queue holding no tokens always takes one prompt, however long (the prompt limit judges
length: router/request_path/limits.py). With no live backend nothing is refused here (the
request path answers "unavailable").

A bound on the predicted wait (``check_wait``, once the policy has chosen): a request is
refused when the time to first token it should expect (``predicted_wait_s``: the larger of
what the fitted costs predict, router/routing/cost_model.py, and the time the backend's
queue takes to start at its measured drain rate, router/request_path/drain_rate.py)
passes its wait budget at every live backend it may go to: the chosen one with the prefix
it has cached, every other one with the whole prompt uncached. The budget is the earliest
of ``max_wait_s``, what is left of the request's deadline (the router's forward deadline,
a gRPC client's own), and an HTTP client's declared timeout (``client_wait_budget_s``).
A backend with neither fitted costs nor a measured drain rate is never refused on a guess;
with ``cold_queue`` set it has room until that many requests are queued there (bound
``cold`` beyond), so a burst at a fresh router is not all admitted before anything is
measured. So a request the fleet cannot start in time is answered 429 at once instead of
expiring later.

``Retry-After`` is ``retry_after_s`` when set, else the least time to first token the
request path predicts for this prompt, uncached, at a live backend (``predict``: the cost
observer's ``predicted_ttft_s``, the same prediction the wait bound weighs, from the costs
router/routing/cost_model.py fits on the fleet): about when the queue ahead of it has
drained. Whole seconds, 1 to 60.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from unicache.plumbing.errors import UsageError
from unicache.router.request_path.core import RouterError
from unicache.router.request_path.drain_rate import DrainRates
from unicache.router.routing.base import ReplicaLoad

RETRY_AFTER_MAX_S = 60
BOUNDS = ("backends_full", "fleet_requests", "fleet_tokens", "wait", "cold")


class Overloaded(RouterError):
    """A request refused by the overload bounds: "overloaded" (RESOURCE_EXHAUSTED / 429),
    with ``retry_after_s``, whole seconds, for the ``Retry-After`` header and the gRPC
    trailing metadata; ``bound``: which bound refused it (a metrics label, ``BOUNDS``)."""

    def __init__(self, message: str, retry_after_s: int, bound: str):
        super().__init__("overloaded", message)
        self.retry_after_s = retry_after_s
        self.bound = bound


def retry_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The gRPC trailing metadata of ``exc``: ``retry-after`` (seconds) and gRPC's own
    ``grpc-retry-pushback-ms`` for an ``Overloaded``, nothing for any other error."""
    if isinstance(exc, Overloaded):
        return (("retry-after", str(exc.retry_after_s)), ("grpc-retry-pushback-ms", str(exc.retry_after_s * 1000)))
    return ()


def retry_headers(exc: BaseException) -> dict[str, str] | None:
    """The HTTP headers of ``exc``'s answer: ``Retry-After`` for an ``Overloaded``."""
    return {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """The overload bounds (module docstring); 0 switches one off.

    Attributes:
        backend_queue: requests one backend may have queued (accepted, not started).
        backend_queue_tokens: queued prompt tokens one backend may hold, in multiples of its
            KV capacity in tokens.
        fleet_queue: requests queued across the fleet (0: the sum of the backends' bounds).
        fleet_queue_tokens: prompt tokens queued across the fleet (0: the sum of the
            backends' token bounds).
        retry_after_s: the ``Retry-After`` of a refusal (0: from the fitted costs).
        max_wait_s: the longest predicted time to first token admitted (0: only the
            request's deadline bounds it).
        cold_queue: requests one backend may have queued while its wait is not measured
            yet (no fitted costs, no drain rate; 0: no bound).
    """

    backend_queue: int = 1024  # a replica's own max_waiting default: both refuse at the same depth
    # NOTE: 4 pools' worth: a queue of one pool turns over in one prefill wave, so a bound of
    # 1 refused four concurrent long prompts on a small replica (unicache demo's flood).
    backend_queue_tokens: float = 4.0
    fleet_queue: int = 0
    fleet_queue_tokens: int = 0
    retry_after_s: int = 0
    max_wait_s: float = 20.0
    cold_queue: int = 0

    def __post_init__(self) -> None:
        for name in ("backend_queue", "fleet_queue", "fleet_queue_tokens", "retry_after_s", "cold_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"overload_{name} must be a non-negative integer, got {value!r}")
        if not math.isfinite(self.backend_queue_tokens) or self.backend_queue_tokens < 0:
            raise UsageError(f"overload_backend_queue_tokens must be a non-negative number, got {self.backend_queue_tokens!r}")
        if not math.isfinite(self.max_wait_s) or self.max_wait_s < 0:
            raise UsageError(f"overload_max_wait_s must be a non-negative number of seconds, got {self.max_wait_s!r}")


def queued_requests(load: ReplicaLoad) -> int:
    """What ``load``'s backend has accepted and not started: ``max(waiting, in_flight -
    running)`` (a backend that reports no running count counts all it has in flight)."""
    return max(load.waiting, load.in_flight - load.running, 0)


class OverloadGuard:
    """Admits or refuses each request against the bounds (single asyncio loop).

    Args:
        config: the bounds.
        block_size: tokens per KV block (a backend's capacity is reported in blocks).
        predict: (backend id, its load, uncached prompt tokens) -> (predicted TTFT s,
            whether fitted): the request path's prediction (``CostObserver.predicted_ttft_s``),
            for the derived ``Retry-After``; None: 1 s.
        registry: where ``unicache_router_overload_rejections_total{bound}`` is counted.
    """

    def __init__(self, config: OverloadConfig, block_size: int,
                 predict: Callable[[str, ReplicaLoad, int], tuple[float, bool]] | None = None,
                 registry: CollectorRegistry | None = None):
        self.config = config
        self.block_size = block_size
        self.predict = predict
        self.drains = DrainRates()
        self.rejections = Counter(
            "unicache_router_overload_rejections",
            "Requests refused with 429 / RESOURCE_EXHAUSTED by the overload bounds (router/request_path/overload.py), "
            "by the bound that refused them (backends_full, fleet_requests, fleet_tokens, wait, cold)",
            ["bound"], registry=registry or CollectorRegistry(),
        )
        for bound in BOUNDS:
            self.rejections.labels(bound)

    def token_bound(self, load: ReplicaLoad) -> int:
        """``load``'s backend's queued-token bound (0: none: switched off, or no capacity reported)."""
        return math.ceil(self.config.backend_queue_tokens * load.capacity_blocks * self.block_size)

    def check(self, loads: list[ReplicaLoad], prompt_tokens: int) -> None:
        """Raise ``Overloaded`` when a request of ``prompt_tokens`` must be refused among
        the live backends ``loads`` (module docstring); else return."""
        if not loads:
            return
        cfg = self.config
        room = False
        fleet_requests = fleet_tokens = bound_requests = bound_tokens = 0
        for load in loads:
            q_requests, q_tokens, t_bound = queued_requests(load), load.queued_prefill_tokens, self.token_bound(load)
            fleet_requests += q_requests
            fleet_tokens += q_tokens
            bound_requests += cfg.backend_queue
            # NOTE: a backend with no token bound leaves the fleet's derived one unbounded too
            bound_tokens = bound_tokens + t_bound if t_bound and bound_tokens >= 0 else -1
            if (not cfg.backend_queue or q_requests < cfg.backend_queue) and (
                    not t_bound or not q_tokens or q_tokens + prompt_tokens <= t_bound):
                room = True
        bound_requests = cfg.fleet_queue or bound_requests
        bound_tokens = cfg.fleet_queue_tokens or max(bound_tokens, 0)
        if not room:
            self._refuse("backends_full", f"every backend's queue is full ({len(loads)} backends; "
                         f"bounds: {cfg.backend_queue} requests, {cfg.backend_queue_tokens:g} x its KV capacity in tokens)",
                         loads, prompt_tokens)
        if bound_requests and fleet_requests >= bound_requests:
            self._refuse("fleet_requests", f"the fleet has {fleet_requests} requests queued (bound {bound_requests})",
                         loads, prompt_tokens)
        if bound_tokens and fleet_tokens and fleet_tokens + prompt_tokens > bound_tokens:
            self._refuse("fleet_tokens", f"the fleet has {fleet_tokens} prompt tokens queued; {prompt_tokens} more would pass "
                         f"its bound ({bound_tokens})", loads, prompt_tokens)

    def wait_budget_s(self, remaining_s: float, client_s: float | None = None) -> float:
        """The longest predicted wait a request may be admitted with: the earliest of
        ``max_wait_s`` (when set), ``remaining_s`` of its deadline and ``client_s``, an HTTP
        client's declared timeout (module docstring)."""
        budget = remaining_s if client_s is None else min(remaining_s, client_s)
        return min(budget, self.config.max_wait_s) if self.config.max_wait_s else budget

    def predicted_wait_s(self, rid: str, load: ReplicaLoad, model: tuple[float, bool]) -> float | None:
        """The time to first token a request dispatched to ``rid`` (at ``load``) should
        expect: the larger of the cost model's prediction ``model`` (seconds, fitted) and
        the time its queued requests take to start at its measured drain rate
        (``DrainRates``). When neither is known yet (the prior's guess, no rate): None
        (room) while it has fewer than ``cold_queue`` requests queued, else infinite."""
        model_s, fitted = model
        rate_known = self.drains.rate(rid) is not None
        if not fitted and not rate_known:  # nothing measured yet: only the cold bound applies
            cold = self.config.cold_queue
            return math.inf if cold and self.drains.queued(rid, load) >= cold else None
        queue_s = self.drains.wait_s(rid, self.drains.queued(rid, load)) if rate_known else 0.0
        return max(model_s if fitted else 0.0, queue_s)

    def check_wait(self, predictions: Iterable[tuple[str, float | None]], budget_s: float) -> None:
        """Raise ``Overloaded`` (bound ``wait``) when every one of ``predictions`` (backend
        id, its ``predicted_wait_s``) is known and passes ``budget_s``; an empty iterable
        refuses nothing. Consumed lazily: the first backend with room ends the check."""
        best_s = math.inf
        seen = False
        for _rid, predicted_s in predictions:
            if predicted_s is None or predicted_s <= budget_s:
                return
            seen = True
            best_s = min(best_s, predicted_s)
        if not seen:
            return
        if math.isinf(best_s):
            self.rejections.labels("cold").inc()
            after = self.config.retry_after_s or 1
            raise Overloaded(f"overloaded: every backend has {self.config.cold_queue} requests queued and its wait is not "
                             f"measured yet; retry after {after} s", after, "cold")
        self.rejections.labels("wait").inc()
        after = self.config.retry_after_s or min(RETRY_AFTER_MAX_S, max(1, math.ceil(best_s - budget_s)))
        raise Overloaded(f"overloaded: every backend's predicted time to first token is past this request's wait budget "
                         f"(best {best_s:.1f} s, budget {budget_s:.1f} s); retry after {after} s", after, "wait")

    def retry_after_s(self, loads: list[ReplicaLoad], prompt_tokens: int) -> int:
        """Whole seconds a refused client should wait (module docstring)."""
        if self.config.retry_after_s:
            return self.config.retry_after_s
        predict = self.predict
        if predict is None:
            return 1
        wait = min(predict(load.replica_id, load, prompt_tokens)[0] for load in loads)
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(wait)))

    def _refuse(self, bound: str, why: str, loads: list[ReplicaLoad], prompt_tokens: int) -> None:
        self.rejections.labels(bound).inc()
        after = self.retry_after_s(loads, prompt_tokens)
        raise Overloaded(f"overloaded: {why}; retry after {after} s", after, bound)
