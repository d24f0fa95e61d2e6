"""What one request goes through in the router, shared by the gRPC and HTTP front doors:
authenticate -> tokenize -> classify -> hash (salted by tenant) -> choose -> forward.

One path for every kind of backend: choosing, admission, retries before the first
token, quarantine, deadlines, cancellation, metrics and session bookkeeping are here;
only the call differs (``Call``): a ``Generate`` to our replicas over the hop or gRPC,
or, for an HTTP client's request to a stock vLLM server, the client's own body relayed
and vLLM's own bytes streamed back (``unicache.router.upstream.vllm_fleet.relay``).
A call fails with ``grpc.aio.AioRpcError`` (the replica transports) or
``UpstreamFailure`` (the relay: no gRPC status between two HTTP ends); both become one
failure (``grpc_failure``) before the rules below apply.

Invariants:
    * Block hashes are computed only with ``unicache.contract.block_hash.hash_token_blocks`` and
      the tenant's salt, exactly as the replica computes them from the forwarded token
      ids and ``cache_salt``; so the index's matches are the replica's cache hits.
    * ``forward`` is two steps: ``_first_message`` (attempts, each ``_attempt``) and a
      streaming loop. A request that fails before its first streamed message with a
      retryable status is retried on up to ``retry_replicas`` other replicas, each a
      replica not tried before, while its deadline allows (a refusal, UNAVAILABLE, is
      not counted: the replica did no work); after the first message nothing is
      retried (tokens were already sent to the client).
    * A replica that refuses a call (UNAVAILABLE; a vLLM server: no connection or
      502/503/504) or sends nothing within its derived
      first-token timeout (``unicache.router.request_path.first_token``) is quarantined at once (the
      stalled call is cancelled); ``unicache.router.cluster.prober`` brings it back.
    * Client-facing messages never carry a replica's address or transport details (gRPC
      details of connection errors name addresses): those go to the log only. Messages
      the replica wrote for the client (a refusal: INVALID_ARGUMENT, RESOURCE_EXHAUSTED)
      are passed on; a vLLM server's own HTTP answer to a relayed request (its status
      and body) reaches the HTTP client as it is (``RouterError.answer``).
    * Every routed request is matched by exactly one ``cluster.finished`` and one
      ``policy.on_request_finished`` (in a finally), including cancellation, and by
      exactly one ``cluster.prefilled``: at its first message, or as it ends without one.
    * A request with an explicit session id is decided on the cluster's record of the
      session's latest turn (``unicache.router.cluster.session_store``, when the router has one
      and Redis is up): it is imported into the policy before the first choice, and the
      policy's record after routing is saved before the request's first message is
      passed on, so a client that sends the next turn after reading this one's response
      finds it through any router. Inferred sessions (``auto-...`` ids) are per router
      and stay local.
    * Every request admitted by the tenant limiter (``unicache.router.request_path.limits``) releases its lease
      exactly once, whatever ends it (finish, error, client cancel).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.contract.wire import REFUSAL_METADATA, request_class_to_proto
from unicache.router.cluster.session_store import SessionStore
from unicache.router.cluster.view import ClusterView, ReplicaRecord
from unicache.router.observability.metrics import RouterMetrics
from unicache.router.request_path.auth import Authenticator
from unicache.router.request_path.classifier import Labels, RequestClassifier
from unicache.router.request_path.cost_observer import CostObserver
from unicache.router.request_path.first_token import FirstTokenTimeout
from unicache.router.request_path.limits import LimitExceeded, TenantLimiter
from unicache.router.routing.base import RouteDecision, RoutingRequest, SharesRouterState, uncached_tokens
from unicache.router.routing.keys import session_key
from unicache.router.upstream.replica_client import RETRYABLE, ReplicaClients, ReplicaStream
from unicache.router.upstream.replica_stream import UpstreamAnswer, UpstreamFailure
from unicache.router.upstream.vllm_fleet.relay import RelayHead, RelayRequest
from unicache.v1 import common_pb2, replica_pb2, router_pb2

log = logging.getLogger(__name__)
_monotonic = time.monotonic

class RouterError(Exception):
    """A request-level failure; each front door maps ``kind`` to its own status.

    ``kind``: invalid (INVALID_ARGUMENT), unauthenticated (UNAUTHENTICATED), overloaded
    (RESOURCE_EXHAUSTED), too_large (RESOURCE_EXHAUSTED: a replica says the request can
    never fit its context or cache), unavailable (UNAVAILABLE), upstream (INTERNAL / the
    replica's status), deadline (DEADLINE_EXCEEDED). The gRPC door uses ``grpc_code``;
    the HTTP door maps kinds in router/frontends/openai_errors.py, or relays ``answer``
    (a vLLM backend's own HTTP answer) as it is.
    """

    GRPC = {
        "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
        "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "unavailable": grpc.StatusCode.UNAVAILABLE,
        "upstream": grpc.StatusCode.INTERNAL,
        "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    }

    def __init__(self, kind: str, message: str, answer: UpstreamAnswer | None = None):
        assert kind in self.GRPC, kind
        self.kind = kind
        self.answer = answer
        super().__init__(message)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.GRPC[self.kind]


_FROM_REPLICA = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNAUTHENTICATED: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
}
# NOTE: a replica never judges the client's credentials: UNAUTHENTICATED from it (a failed
# hop handshake or TLS identity check, a refused cluster credential, a peer that is not
# the replica) is the replica failing, a refusal like UNAVAILABLE: quarantined and retried
# elsewhere without using up the retry budget.
_REFUSALS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED})


# Codes whose details the replica wrote for the client (why it refused the request);
# every other code's details come from the transport or an internal failure and may name
# addresses, so the client gets ``_GENERIC`` instead.
_REPLICA_WORDS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
_GENERIC = {
    "unavailable": "replica unavailable",
    "deadline": "replica did not answer in time",
    "upstream": "replica failed",
}

# After the first message nothing is retried; a replica that went away mid-stream (its
# process died) is UNAVAILABLE to the client too, so clients can tell it from a bug.
_MID_STREAM = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
}


def client_message(rid: str, exc: grpc.aio.AioRpcError, kind: str) -> str:
    """What the client is told about replica ``rid``'s failure before its first message."""
    if exc.code() in _REPLICA_WORDS and exc.details():
        return f"replica {rid}: {exc.details()}"
    return _GENERIC[kind] if kind in _GENERIC else f"replica failed ({exc.code().name})"


def _replica_error_kind(exc: grpc.aio.AioRpcError) -> str:
    """RouterError kind of a replica's refusal; RESOURCE_EXHAUSTED is "too_large" when the
    replica marks it so (unicache.contract.wire.REFUSAL_METADATA), else "overloaded"."""
    kind = _FROM_REPLICA.get(exc.code(), "upstream")
    if kind == "overloaded" and dict(exc.trailing_metadata() or ()).get(REFUSAL_METADATA) == "too_large":
        return "too_large"
    return kind


def grpc_failure(rid: str, exc: grpc.aio.AioRpcError, timed_out: bool) -> UpstreamFailure:
    """A replica call's gRPC status before its first message, in the request path's terms."""
    code = exc.code()
    kind = _replica_error_kind(exc)
    refused = code in _REFUSALS
    return UpstreamFailure(kind, client_message(rid, exc, kind), refused=refused,
                           stalled=timed_out or code == grpc.StatusCode.DEADLINE_EXCEEDED, retryable=code in RETRYABLE)


@dataclass(slots=True)
class Prepared:
    """A request after classification and hashing, before it is sent."""

    request_id: str
    tenant: str
    token_ids: list[int]
    salt: bytes
    cls: RequestClass
    routing: RoutingRequest
    prepare_s: float = 0.0  # time spent hashing and classifying
    arrival: float = 0.0  # perf_counter when preparation began (TTFT origin)
    shared_session: str | None = None  # session key shared with other routers (explicit ids)
    model: str = ""  # the model the request names ("": the router's served_model_name); router/cluster/models.py
    adapter: str = ""  # the LoRA adapter it names ("": none): an extra key of every block hash, the model vLLM gets


@dataclass(slots=True)
class Call:
    """What one request sends, in the form the chosen backend takes: our replicas (and a
    vLLM backend read as messages: the gRPC door, a batch of prompts) get a
    ``GenerateRequest``, built only then; a vLLM backend gets ``relay``, the HTTP
    client's own body, and answers with its own bytes."""

    prep: Prepared
    sampling: common_pb2.SamplingParams
    request_class: common_pb2.RequestClass
    relay: RelayRequest | None = None
    wait_budget_s: float | None = None  # an HTTP client's declared timeout (OverloadGuard.wait_budget_s)
    _request: replica_pb2.GenerateRequest | None = None

    def request(self) -> replica_pb2.GenerateRequest:
        if self._request is None:
            prep = self.prep
            self._request = replica_pb2.GenerateRequest(
                request_id=prep.request_id,
                token_ids=replica_pb2.TokenIds(ids=prep.token_ids),
                sampling=self.sampling,
                request_class=self.request_class,
                cache_salt=prep.salt,
                adapter_id=prep.adapter,
            )
        return self._request


@dataclass(slots=True)
class Attempt:
    """A replica call that sent its first message (``first``; None: it ended empty; a
    ``RelayHead`` when vLLM's own bytes are relayed)."""

    decision: RouteDecision
    replica: ReplicaRecord
    stream: ReplicaStream
    first: replica_pb2.GenerateResponse | RelayHead | None


class AttemptFailed(Exception):
    """One attempt failed before its first message; ``retryable``: worth another replica;
    ``refused``: the replica answered UNAVAILABLE (it did no work on the request)."""

    def __init__(self, error: RouterError, retryable: bool, refused: bool = False):
        super().__init__(str(error))
        self.error = error
        self.retryable = retryable
        self.refused = refused


@dataclass(slots=True)
class Labelled:
    """Explicit labels from the request (fields or headers); None = infer."""

    session_id: str | None = None
    task: str | None = None
    template: bool | None = None


class RouterCore:
    """The request path. Front doors call ``prepare`` then iterate ``forward``.

    Args:
        cluster: replicas, loads and the locality index (with the routing policy).
        auth: API keys and tenant salts.
        tokenizer: same tokenizer as the replicas (``unicache.contract.tokenizer``).
        classifier: ``unicache.router.request_path.classifier.RequestClassifier``.
        clients: replica gRPC channels.
        metrics: Prometheus metrics.
        block_size: KV block size (must equal the replicas').
        max_in_flight: requests in flight beyond which new ones get "overloaded".
        max_session_id_chars: longer session ids are "invalid" (default 256): the
            classifier and the policy remember session ids, so their size must be bounded.
        clock: seconds for the classifier's inter-turn gaps (default ``time.monotonic``).
        limits: per-tenant admission limits (default: none).
        first_token_timeout: derives each replica's first-token timeout from its measured
            time to first token; a replica that streams nothing that long is cancelled,
            quarantined, and the request retried elsewhere (None: wait for the deadline).
        retry_replicas: failures before the first message are retried on up to this many
            other replicas (default 2), each tried once, within the request's deadline;
            refusals (UNAVAILABLE) move on to another replica without counting.
        sessions: the session placement shared with the cluster's other routers (None:
            this router's policy memory only); needs a policy that implements
            ``SharesRouterState`` (its ``import_session`` / ``export_session``).
        costs: feeds the backends' cost model from every request
            (``unicache.router.request_path.cost_observer``; default: one that feeds
            ``cluster.cost_model`` without a queue share or metric).
        overload: refuses a request when the backends' queues are full
            (``unicache.router.request_path.overload.OverloadGuard``; None: no bound).
    """

    def __init__(
        self,
        cluster: ClusterView,
        auth: Authenticator,
        tokenizer,
        classifier: RequestClassifier,
        clients: ReplicaClients,
        metrics: RouterMetrics,
        block_size: int = 16,
        max_in_flight: int = 4096,
        max_session_id_chars: int = 256,
        clock: Callable[[], float] = time.monotonic,
        limits: TenantLimiter | None = None,
        first_token_timeout: FirstTokenTimeout | None = None,
        retry_replicas: int = 2,
        sessions: SessionStore | None = None,
        costs: CostObserver | None = None,
        overload=None,
    ):
        if retry_replicas < 0:
            raise ValueError("retry_replicas must be >= 0")
        if sessions is not None and not isinstance(cluster.policy, SharesRouterState):
            raise ValueError("a shared session store needs a policy that implements SharesRouterState")
        self.cluster = cluster
        self.auth = auth
        self.tokenizer = tokenizer
        self.classifier = classifier
        self.clients = clients
        self.metrics = metrics
        self.block_size = block_size
        self.max_in_flight = max_in_flight
        self.max_session_id_chars = max_session_id_chars
        self.clock = clock
        self.limits = limits or TenantLimiter()
        self.first_token_timeout = first_token_timeout
        self.retry_replicas = retry_replicas
        self.sessions = sessions
        self.costs = costs if costs is not None else CostObserver(cluster.cost_model)
        self.overload = overload
        cluster.removal_hooks.append(self._forget_replica)

    def _forget_replica(self, replica_id: str) -> None:
        """The replica left the cluster: its metric series and estimates go with it."""
        self.metrics.forget_replica(replica_id)
        self.clients.forget_replica(replica_id)
        self.costs.model.forget(replica_id)
        if self.overload is not None:
            self.overload.drains.forget(replica_id)
        if self.first_token_timeout is not None:
            self.first_token_timeout.forget(replica_id)

    @property
    def policy(self):
        return self.cluster.policy

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text``'s token ids; ``add_special_tokens=True`` for a completion prompt (the
        tokenizer's BOS, as vLLM), False for a rendered chat template (unicache/contract/tokenizer.py)."""
        return list(self.tokenizer.encode(text, add_special_tokens))

    def prepare(self, tenant: str, token_ids: list[int], labels: Labelled, model: str = "") -> Prepared:
        """Classify and hash; raises RouterError("invalid") for empty prompts or bad labels.
        ``model``: the model the request names, already known to ``cluster.models`` ("":
        the router's own); a LoRA adapter is hashed into every block, as vLLM does."""
        if not token_ids:
            raise RouterError("invalid", "empty prompt: the prompt must contain at least one token")
        try:
            self.limits.check_prompt(tenant, len(token_ids))
        except LimitExceeded as exc:
            self.metrics.labelled(self.metrics.limit_rejections, exc.limit).inc()
            raise RouterError(exc.kind, str(exc)) from None
        if labels.session_id and len(labels.session_id) > self.max_session_id_chars:
            raise RouterError("invalid", f"session_id is longer than {self.max_session_id_chars} characters")
        try:
            task = Task.parse(labels.task) if labels.task else None
        except ValueError as exc:
            raise RouterError("invalid", str(exc)) from None
        t0 = time.perf_counter()
        salt = self.auth.cache_salt(tenant)
        adapter = self.cluster.models.adapter(model) if model else ""
        hashes = hash_token_blocks(token_ids, self.block_size, cache_salt=salt, adapter_id=adapter or None)
        cls = self.classifier.classify(
            hashes,
            Labels(tenant=tenant, session_id=labels.session_id or None, task=task, template=labels.template),
            self.clock(),
        )
        request_id = uuid.uuid4().hex
        routing = RoutingRequest(request_id, cls, hashes, len(token_ids), self.block_size)
        shared = session_key(tenant, labels.session_id) if labels.session_id and self.sessions is not None else None
        return Prepared(request_id, tenant, token_ids, salt, cls, routing, time.perf_counter() - t0, t0, shared, model, adapter)

    def choose(self, routing: RoutingRequest, exclude: set[str], extra_s: float = 0.0) -> RouteDecision:
        """The policy's choice among live replicas not in ``exclude``; the routing-latency
        histogram gets the choice time plus ``extra_s`` (hashing and classifying)."""
        t0 = time.perf_counter()
        # NOTE: quarantined replicas are the last resort: with every replica quarantined
        # (one replica that hiccuped), trying one beats failing for certain.
        loads = self.cluster.loads(exclude) or self.cluster.loads(exclude, quarantined=True)
        if not loads:
            raise RouterError("unavailable", "no replicas available")
        decision = self.policy.choose(routing, loads, self.cluster.locality())
        self.metrics.routing_latency.observe(time.perf_counter() - t0 + extra_s)
        return decision

    def route_info(
        self, prep: Prepared, decision: RouteDecision, request_class: common_pb2.RequestClass | None = None
    ) -> router_pb2.RouteInfo:
        """The RouteInfo of ``decision``; ``request_class``: ``prep.cls`` as proto, if the
        caller already has it."""
        return router_pb2.RouteInfo(
            replica_id=decision.replica_id,
            reason=decision.reason,
            matched_tokens=decision.matched_blocks * self.block_size,
            score=decision.score,
            request_class=request_class if request_class is not None else request_class_to_proto(prep.cls),
        )

    async def forward(
        self, prep: Prepared, sampling: common_pb2.SamplingParams, timeout_s: float | None = None,
        relay: RelayRequest | None = None, wait_budget_s: float | None = None,
    ) -> AsyncIterator[tuple[router_pb2.RouteInfo | None, replica_pb2.GenerateResponse | RelayHead | bytes]]:
        """Route and stream the replica's messages; the first pair carries the RouteInfo.

        ``timeout_s``: the client's own deadline, if it set one (gRPC); the request's
        deadline is the earlier of it and the forward deadline, counted from arrival.
        ``relay``: the HTTP client's request, relayed as it is when a vLLM backend takes
        it: the first message is then a ``RelayHead`` and the rest vLLM's bytes
        (``unicache.router.upstream.vllm_fleet.relay``); ``relay.only_vllm`` offers the
        policy vLLM backends only. ``wait_budget_s``: an HTTP client's declared timeout
        (``x-stainless-read-timeout``): no request is admitted that the fitted costs
        predict cannot start within it (``OverloadGuard.check_wait``).

        Two steps: ``_first_message`` (choose, call, retry elsewhere until a replica sends
        its first message) and the streaming loop below (relay; never retried).

        Raises RouterError before the first message (no replica, all failed, bad input,
        a tenant limit) or later when the replica stream breaks mid-way.
        """
        # NOTE: one generator, no inner ones: every streamed message passes each generator
        # layer once, and the front door's own layers already cost per token.
        lease = self.admit(prep)
        try:
            call = Call(prep, sampling, request_class_to_proto(prep.cls), relay, wait_budget_s)
            deadline = prep.arrival + min(self.clients.forward_deadline_s, timeout_s if timeout_s is not None else float("inf"))
            attempt = await self._first_message(prep, call, deadline)
            rid = attempt.decision.replica_id
            try:
                if attempt.first is None:
                    return
                yield self.route_info(prep, attempt.decision, call.request_class), attempt.first
                stream, rec = attempt.stream, attempt.replica
                relayed = isinstance(attempt.first, RelayHead)
                if not relayed:
                    self._count_usage(rid, attempt.first)
                    self.costs.message(prep.request_id, attempt.first)
                try:
                    while (msg := await stream.next()) is not None:
                        rec.last_message = _monotonic()  # progress: this replica is not stalled
                        if not relayed:
                            self._count_usage(rid, msg)
                            self.costs.message(prep.request_id, msg)
                        yield None, msg
                except grpc.aio.AioRpcError as exc:
                    raise self._broken_stream(rid, exc.code().name, exc.details(), exc.code() == grpc.StatusCode.UNAVAILABLE,
                                              _MID_STREAM.get(exc.code(), "upstream")) from None
                except UpstreamFailure as failure:
                    raise self._broken_stream(rid, failure.kind, failure.detail, failure.kind == "unavailable", failure.kind) from None
                if relayed:
                    self._count_relayed_usage(prep, rid, stream.usage)
            finally:
                self._end_attempt(prep, rid, attempt.stream)
        finally:
            lease.release()

    def admit(self, prep: Prepared):
        """The router-wide in-flight cap, the overload bounds, then the tenant's lease (released by the caller)."""
        if self.cluster.total_in_flight() >= self.max_in_flight:
            raise RouterError("overloaded", f"router has {self.max_in_flight} requests in flight; retry later")
        if self.overload is not None:  # the backends' queues, before any token is computed
            self.overload.check(self.cluster.loads(), len(prep.token_ids))
        try:
            return self.limits.acquire(prep.tenant, len(prep.token_ids))
        except LimitExceeded as exc:
            self.metrics.labelled(self.metrics.limit_rejections, exc.limit).inc()
            raise RouterError(exc.kind, str(exc)) from None

    async def _first_message(self, prep: Prepared, call: Call, deadline: float) -> Attempt:
        """Attempts on distinct replicas until one sends its first message (or ends its
        stream empty); the returned attempt is open and counted in flight.

        Each replica at most once; at most ``retry_replicas`` retries after failures that
        may have cost the replica work (refusals, UNAVAILABLE, do not count); none started
        past ``deadline`` (``time.perf_counter`` seconds). Raises the last attempt's RouterError when it is
        not retryable or no attempt is left, RouterError("unavailable") when no replica
        was available at all, and RouterError("deadline") when the deadline passed first.
        """
        tried: set[str] = set()
        # NOTE: the one place a request's model narrows its candidates: replicas outside
        # the model's group are never offered to the policy (router/cluster/models.py).
        outside = self.cluster.models.outside(prep.model, self.cluster.replicas)
        if call.relay is not None and call.relay.only_vllm:  # parameters only vLLM interprets
            outside = outside | {rid for rid, rec in self.cluster.replicas.items() if rec.kind != "vllm"}
        worked = 0  # failed attempts at replicas that may have worked on the request
        last_error: RouterError | None = None
        if prep.shared_session is not None and self.cluster.redis_connected:
            record = await self.sessions.load(prep.shared_session)
            if record is not None:
                self.policy.import_session(prep.shared_session, record)
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RouterError("deadline", f"no replica answered within the request's deadline ({len(tried)} tried)")
            try:
                decision = self.choose(prep.routing, tried | outside if outside else tried, 0.0 if tried else prep.prepare_s)
            except RouterError:
                if last_error is not None:
                    raise last_error from None  # no other replica to retry on
                raise
            if not tried and self.overload is not None:  # before any token is computed
                self.overload.check_wait(self._predicted_waits(prep, decision, outside),
                                         self.overload.wait_budget_s(remaining, call.wait_budget_s))
            if tried:
                self.metrics.retries.inc()
            try:
                return await self._attempt(prep, call, decision, remaining)
            except AttemptFailed as failed:
                tried.add(decision.replica_id)
                if not failed.retryable:
                    raise failed.error from None
                # NOTE: a refusal (UNAVAILABLE before any message: nothing listening, or
                # shutting down) did no work and took milliseconds, so it does not use up
                # the retry budget; each replica is still tried at most once.
                if not failed.refused:
                    worked += 1
                    if worked > self.retry_replicas:
                        raise failed.error from None
                last_error = failed.error

    def _predicted_waits(self, prep: Prepared, decision: RouteDecision, outside: set[str]) -> Iterator[tuple[str, float | None]]:
        """(backend, ``OverloadGuard.predicted_wait_s``) for the chosen backend with its
        cached prefix, then lazily for every other live candidate with the whole prompt
        uncached (what ``OverloadGuard.check_wait`` weighs)."""
        rid = decision.replica_id
        guard, costs = self.overload, self.costs
        load = self.cluster.replicas[rid].load
        yield rid, guard.predicted_wait_s(rid, load, costs.predicted_ttft_s(rid, load, uncached_tokens(prep.routing, decision)))
        for load in self.cluster.loads():
            other = load.replica_id
            if other != rid and other not in outside:
                yield other, guard.predicted_wait_s(other, load, costs.predicted_ttft_s(other, load, prep.routing.num_prompt_tokens))

    async def _attempt(self, prep: Prepared, call: Call, decision: RouteDecision, remaining_s: float) -> Attempt:
        """Call ``decision``'s replica (deadline ``remaining_s``) and wait for its first
        message, at most its first-token timeout.

        On success the call stays open and counted (the caller ends it with
        ``_end_attempt``); on any failure, cancellation included, it is ended here.
        Raises AttemptFailed for a replica error; a refusal or a stall quarantines it.
        """
        rid = decision.replica_id
        rec = self.cluster.replicas[rid]
        relay = call.relay if rec.kind == "vllm" else None
        # NOTE: an unstreamed answer relayed from vLLM comes whole at the end: its wait is
        # the whole generation, neither a first token nor a stall (the deadline bounds it).
        streamed = relay is None or relay.stream
        self.costs.dispatched(prep.routing, decision, rec.load, streamed)  # the load before this request
        self.cluster.pending.add(rid, prep.routing.block_hashes)  # known at once, before any event
        self.cluster.started(rid, prep.routing.num_prompt_tokens)
        self.policy.on_request_routed(prep.routing, decision)
        saving = None
        if prep.shared_session is not None and self.cluster.redis_connected:
            record = self.policy.export_session(prep.shared_session)
            if record is not None:
                # NOTE: written while the replica works on the request, awaited before its
                # first message is passed on (so it never delays the request itself).
                saving = asyncio.ensure_future(self.sessions.save(prep.shared_session, record))
        self.metrics.labelled(self.metrics.decisions, decision.reason, rid).inc()
        ftt = self.first_token_timeout if streamed else None
        first_timeout = ftt.timeout_s(rid) if ftt is not None else None
        use_timeout = first_timeout is not None and first_timeout < remaining_s
        drains = self.overload.drains if self.overload is not None else None
        if drains is not None:
            drains.dispatched(rid)  # matched below by started, or abandoned on every failure path
        t0 = time.perf_counter()
        if relay is not None:
            stream = self.clients.vllm.relay(rec.address, relay, prep.adapter, prep.salt, call.request_class, remaining_s)
        else:
            stream = self.clients.generate(rec.address, call.request(), remaining_s, rec.hop_address, rid)
        try:
            if use_timeout:
                first = await stream.first(first_timeout, lambda: rec.last_message, ftt.ceiling_s)
            else:
                first = await stream.first()
            if saving is not None:
                await saving
        except grpc.aio.AioRpcError as exc:
            self._end_unstarted(prep, rid, stream, drains)
            log.info("replica %s at %s failed before its first message: %s %s", rid, rec.address, exc.code().name, exc.details())
            raise self._failed_attempt(rid, grpc_failure(rid, exc, stream.timed_out), stream.timed_out) from None
        except UpstreamFailure as failure:
            self._end_unstarted(prep, rid, stream, drains)
            log.info("backend %s at %s failed before its first message: %s", rid, rec.address, failure.detail)
            raise self._failed_attempt(rid, failure, stream.timed_out) from None
        except BaseException:
            self._end_unstarted(prep, rid, stream, drains)
            raise
        now = time.perf_counter()
        rec.last_message = time.monotonic()
        self.cluster.prefilled(rid, prep.routing.num_prompt_tokens)
        self.policy.on_first_token(prep.routing, rid)
        self.costs.first_token(prep.request_id)
        if drains is not None:
            drains.started(rid)
        if ftt is not None:
            ftt.observe(rid, now - t0)
        if streamed:
            self.metrics.ttft.observe(now - prep.arrival)
            self.metrics.labelled(self.metrics.replica_ttft, rid).observe(now - prep.arrival)
        self.metrics.matched_tokens.inc(decision.matched_blocks * self.block_size)
        return Attempt(decision, rec, stream, first)

    def _failed_attempt(self, rid: str, failure: UpstreamFailure, timed_out: bool) -> AttemptFailed:
        """Quarantine the replica if it refused or stalled (its first-token timeout or the
        call's deadline passed), and return what the client may be told."""
        if timed_out:
            self.metrics.labelled(self.metrics.first_token_timeouts, rid).inc()
        stalled = failure.stalled
        if (stalled or failure.refused) and self.cluster.quarantine(rid):
            # NOTE: once per quarantine, not per request: the requests a stall catches
            # together are one event, and must not double the timeout once each.
            if stalled and self.first_token_timeout is not None:
                self.first_token_timeout.timed_out(rid)
            self.metrics.labelled(self.metrics.quarantines, rid).inc()
            log.warning("replica %s quarantined (%s) until it answers a probe", rid, "stalled" if stalled else "refused")
        error = RouterError(failure.kind, failure.message, failure.answer)
        return AttemptFailed(error, failure.retryable, failure.refused)

    def _end_unstarted(self, prep: Prepared, rid: str, stream: ReplicaStream, drains) -> None:
        """End an attempt that failed before its first message (``drains``: the overload
        guard's, which counted it as unstarted, or None)."""
        if drains is not None:
            drains.abandoned(rid)
        self.cluster.prefilled(rid, prep.routing.num_prompt_tokens)
        self._end_attempt(prep, rid, stream)

    def _end_attempt(self, prep: Prepared, rid: str, stream: ReplicaStream) -> None:
        """Close the call (cancelling it at the replica if unfinished) and uncount it."""
        stream.close()
        self.cluster.finished(rid)
        self.policy.on_request_finished(prep.routing, rid)
        self.costs.finished(prep.request_id)

    def _broken_stream(self, rid: str, what: str, details: str, lost: bool, kind: str) -> RouterError:
        """The client's error for a replica stream that broke after its first message
        (``what``: the status or failure kind; ``lost``: the replica went away, quarantined)."""
        rec = self.cluster.replicas.get(rid)
        log.info("replica %s at %s failed mid-stream: %s %s", rid, rec.address if rec else "?", what, details)
        self.metrics.labelled(self.metrics.broken_streams, rid, kind).inc()
        if lost and self.cluster.quarantine(rid):
            self.metrics.labelled(self.metrics.quarantines, rid).inc()
            log.warning("replica %s quarantined (%s mid-stream) until it answers a probe", rid, what)
        return RouterError(
            kind, f"replica {rid} failed after the response started ({what}); the response is incomplete, retry the request",
        )

    def _count_usage(self, rid: str, msg: replica_pb2.GenerateResponse) -> None:
        if msg.HasField("usage") and msg.index == 0:
            u = msg.usage
            m = self.metrics
            m.labelled(m.cached_tokens, rid).inc(u.cached_tokens)
            m.labelled(m.computed_tokens, rid).inc(max(0, u.prompt_tokens - u.cached_tokens))

    def _count_relayed_usage(self, prep: Prepared, rid: str, usage: dict | None) -> None:
        """vLLM's final usage of a relayed answer (None: it sent none)."""
        if usage is None:
            return
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        m = self.metrics
        m.labelled(m.cached_tokens, rid).inc(cached)
        m.labelled(m.computed_tokens, rid).inc(max(0, prompt - cached))
        self.costs.usage(prep.request_id, prompt, cached, int(usage.get("completion_tokens") or 0))
