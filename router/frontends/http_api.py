"""The OpenAI-compatible HTTP front door (Starlette, served by uvicorn on the router's loop).

Routes:
    POST /v1/completions, POST /v1/chat/completions   (``stream: true`` -> server-sent
        events ending with ``data: [DONE]``; otherwise one JSON body)
    GET  /v1/models, /v1/models/{model}, /healthz, /readyz, /health, /metrics,
        /v1/cluster/state, /v1/cluster/costs, /dashboard, /dashboard/history

``/healthz`` is liveness (200 while the process serves); ``/readyz`` and vLLM's ``/health``
are readiness: 200 when a request can be routed (a healthy replica), else 503.

Request fields are parsed in ``openai_request`` (what is supported, refused, defaulted:
docs/openai.md), responses built in ``openai_response``, and every error goes through
``openai_errors.to_api_error`` (one mapping; unknown paths and wrong methods too).

Explicit labels: body fields ``session_id``, ``task``, ``template`` (extensions) or
headers ``x-session-id``, ``x-unicache-task``, ``x-unicache-template``; body wins.
Routing is decided before the response starts, so every generating response (streaming
too) carries ``x-unicache-replica`` and ``x-unicache-route-reason`` (comma-separated, one
per prompt, for a batch of prompts).

A single prompt whose request a vLLM backend takes is relayed: vLLM gets the client's own
body and the client vLLM's own bytes, with the headers above
(router/upstream/vllm_fleet/relay.py); a batch of prompts and our replicas' answers are
read as messages and built here.

Metrics: each HTTP request counts once in ``requests{api, outcome}``; a client that
goes away (during the upload, before the answer, or mid-stream) counts "cancelled",
never as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from unicache.contract.chat_template import render_chat
from unicache.router.frontends.admin import require_admin
from unicache.router.observability.cluster_state import cluster_state
from unicache.router.observability.dashboard import DASHBOARD_HTML
from unicache.router.observability.history import ClusterHistory
from unicache.router.request_path.auth import api_key_from_headers
from unicache.router.request_path.core import RouterCore
from unicache.router.frontends.openai_errors import (
    CLIENT_CLOSED,
    MAPPED,
    ApiError,
    error_response,
    sse_error_event,
    to_api_error,
    unsupported,
)
from unicache.router.frontends.openai_request import (
    DEFAULT_MAX_BATCH_PROMPTS,
    DEFAULT_MAX_JSON_DEPTH,
    OpenAIRequest,
    check_model,
    client_wait_budget_s,
    parse_body,
    parse_request,
    unimplemented_fields,
)
from unicache.router.frontends.http_server import DISCONNECT_HOOKS_SCOPE_KEY, TIMED_OUT_SCOPE_KEY
from unicache.router.frontends.openai_response import FINISH, CompletionLogprobs, StreamChunks, TokenText, UsageTally, base, chat_logprobs
from unicache.router.upstream.vllm_fleet.relay import RelayHead, RelayRequest
from unicache.v1 import replica_pb2

log = logging.getLogger(__name__)

API_PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}  # chat -> the generation API's path (the router's and vLLM's)

DEFAULT_MAX_BODY_BYTES = 8 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed ``limit``:
    from ``content-length`` before reading, else while streaming it in, so an oversized
    body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {int(declared)} bytes; the limit is {limit}", "payload_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "payload_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Watch:
    """Cancels the request's task when its client disconnects, for the whole request
    (waiting for the first messages, collecting a body, or streaming one). On the router's
    own server (``http_server``) the connection's loss runs a hook the watch leaves in the
    scope; elsewhere one watcher task reads ``receive`` for ``http.disconnect``.

    The code it guards catches ``asyncio.CancelledError`` and calls ``caught()``: True
    means the client went away (the task is un-cancelled; the caller answers 499), False
    that someone else cancelled (re-raise). ``close()`` ends the watch; it must run before
    the response's last message is sent, so a response that completes is never cancelled.
    Cancelling the generation closes the replica calls, so an abandoned request stops
    computing at once.
    """

    __slots__ = ("task", "gone", "closed", "_watcher")

    def __init__(self, scope, receive):  # noqa: ANN001
        self.task = asyncio.current_task()
        self.gone = False
        self.closed = False
        hooks = scope.get(DISCONNECT_HOOKS_SCOPE_KEY)
        if hooks is not None:
            hooks.append(self._disconnected)
            self._watcher = None
        else:
            self._watcher = asyncio.create_task(self._watch(receive))

    def _disconnected(self) -> None:
        if not self.closed:
            self.gone = True
            self.task.cancel()

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected()
                return

    def caught(self) -> bool:
        if not self.gone:
            return False
        self.close()
        self.task.uncancel()
        return True

    def close(self) -> None:
        self.closed = True
        if self._watcher is not None:
            self._watcher.cancel()


class _EventStream(Response):
    """A ``text/event-stream`` response of ``body``'s events that stops when the client
    goes away (``watch``): Starlette's StreamingResponse, without its task group (on
    uvicorn's ASGI 2.3 it runs two tasks and a cancel scope per response)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], watch: _Watch, headers: dict[str, str]):
        self.body_iterator = body
        self.watch = watch
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        watch, body = self.watch, self.body_iterator
        try:
            # NOTE: the body is started before anything is sent: closing an async generator
            # that never started runs none of its code, so a client gone before the first
            # send would leave the upstream calls to the garbage collector.
            first = await anext(body, None)
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.close()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.caught():
                raise
        finally:
            watch.close()
            await body.aclose()  # runs its finally where it was left at a yield


async def _first_messages(agens: list) -> list[tuple[Any, replica_pb2.GenerateResponse]]:
    """The first (route, message) of every stream; the first failure is raised."""
    if len(agens) == 1:
        return [await agens[0].__anext__()]
    results = await asyncio.gather(*(a.__anext__() for a in agens), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def _merged(agens: list, firsts: list) -> AsyncIterator[tuple[int, replica_pb2.GenerateResponse]]:
    """(prompt index, message) from every stream as they come; one stream is read
    directly (no tasks on the common path). A failure in any stream is raised here."""
    if len(agens) == 1:
        yield 0, firsts[0][1]
        async for _, msg in agens[0]:
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for _, msg in agens[i]:
                await queue.put((i, msg))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))

    for i, (_, msg) in enumerate(firsts):
        queue.put_nowait((i, msg))
    tasks = [asyncio.create_task(pump(i)) for i in range(len(agens))]
    try:
        open_streams = len(agens)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class HttpFrontDoor:
    """Builds the Starlette app over a ``RouterCore``.

    Args:
        core: the request path.
        served_model_name: the router's own model name (its replicas'; default
            "unicache-default"); vLLM backends add the models and adapters they list
            (router/cluster/models.py). ``/v1/models`` lists them all; a request naming
            another gets 404 ``model_not_found``.
        policy_name: shown in ``/v1/cluster/state``.
        max_body_bytes: larger request bodies get 413 without being read whole (8 MiB).
        max_json_depth: deeper JSON nesting is a 400 (64).
        max_batch_prompts: most prompts in one completions request (64).
        admin_key: when set, the operator endpoints need it (router/frontends/admin.py).
        history: the dashboard's history (router/observability/history.py) ``/dashboard/history`` serves;
            None: a fresh one, sampled only when asked (tests).
    """

    def __init__(
        self,
        core: RouterCore,
        served_model_name: str = "unicache-default",
        policy_name: str = "",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
        max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
        admin_key: str = "",
        history: ClusterHistory | None = None,
    ):
        self.core = core
        self.history = history if history is not None else ClusterHistory(core.metrics, core.cluster)
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_batch_prompts = max_batch_prompts
        self.model_name = served_model_name
        core.cluster.models.alias = served_model_name
        self.policy_name = policy_name
        self.token_text = TokenText(core.tokenizer)

        def admin(endpoint):
            return require_admin(admin_key, endpoint, lambda: error_response(ApiError(401, "admin key required", "invalid_api_key")))

        self._generation_paths = {path: chat for chat, path in API_PATHS.items()}  # path -> chat
        self._starlette = Starlette(
            routes=[
                Route(API_PATHS[False], self.completions, methods=["POST"]),
                Route(API_PATHS[True], self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", admin(self.metrics), methods=["GET"]),
                Route("/v1/cluster/state", admin(self.state), methods=["GET"]),
                Route("/v1/cluster/costs", admin(self.costs), methods=["GET"]),
                Route("/dashboard", admin(self.dashboard), methods=["GET"]),
                Route("/dashboard/history", admin(self.dashboard_history), methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception, Exception: self._server_error},
        )

    async def app(self, scope, receive, send) -> None:  # noqa: ANN001
        """The ASGI app. A generation request (POST to one of the two generation paths)
        goes straight to its endpoint, skipping Starlette's middleware, router and endpoint
        wrappers (four layers of calls per request and two send wrappers per streamed
        event); it keeps their behaviour: an exception before the response starts is the
        500 ``internal_error`` body, and it is re-raised for uvicorn to log. Everything
        else (other paths and methods, 404s and 405s) is Starlette's."""
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            chat = self._generation_paths.get(scope["path"])
            if chat is not None:
                try:
                    response = await self._generate(Request(scope, receive, send), chat)
                except Exception:
                    await _internal_error()(scope, receive, send)
                    raise
                await response(scope, receive, send)
                return
        await self._starlette(scope, receive, send)

    # --- errors -------------------------------------------------------------------------
    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 (unknown path) and 405 (wrong method), in OpenAI's shape."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = ApiError(404, f"Invalid URL ({where})", "unknown_url")
        elif exc.status_code == 405:
            err = ApiError(405, f"Method not allowed ({where})", "method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        return error_response(err, headers=dict(exc.headers or {}))

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        return _internal_error()

    def _count(self, api: str, outcome: str) -> None:
        self.core.metrics.requests.labels(api, outcome).inc()

    # --- plain endpoints --------------------------------------------------------------
    def _model_cards(self) -> list[dict[str, Any]]:
        """vLLM's model cards of every model served: the router's own name first, then each
        backend's base models and LoRA adapters (``parent``: the adapter's base model)."""
        return [{"id": c.name, "object": "model", "created": 0, "owned_by": "unicache", "root": c.parent or c.name,
                 "parent": c.parent, "max_model_len": c.max_model_len}
                for c in self.core.cluster.models.cards(self.max_model_len())]

    def max_model_len(self) -> int | None:
        """The context every replica serves, as vLLM's model card reports it: the smallest
        ``max_model_len`` in the replicas' heartbeats (None when none reports one: static
        replicas send no heartbeat)."""
        lens = [rec.heartbeat.max_model_len for rec in self.core.cluster.replicas.values()
                if rec.heartbeat is not None and rec.heartbeat.max_model_len]
        return min(lens) if lens else None

    async def models(self, request: Request) -> Response:
        try:
            self.core.auth.authenticate(api_key_from_headers(request.headers.get))
        except MAPPED as exc:
            return error_response(to_api_error(exc))
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        try:
            self.core.auth.authenticate(api_key_from_headers(request.headers.get))
            name = check_model({"model": request.path_params["model"]}, self.core.cluster.models)
        except MAPPED as exc:
            return error_response(to_api_error(exc))
        return JSONResponse(next(card for card in self._model_cards() if card["id"] == name))

    async def healthz(self, request: Request) -> Response:
        c = self.core.cluster
        return JSONResponse({"status": "ok", "replicas": len(c.replicas), "redis_connected": c.redis_connected})

    async def readyz(self, request: Request) -> Response:
        n = len(self.core.cluster.loads())
        return JSONResponse({"ready": n > 0, "replicas": n}, status_code=200 if n else 503)

    async def health(self, request: Request) -> Response:
        """vLLM's health check, for load balancers: an empty 200 when a request can be
        routed now, else 503 (OpenAI error body), as ``/readyz``."""
        if self.core.cluster.loads():
            return Response(status_code=200)
        return error_response(ApiError(503, "no healthy replica", "service_unavailable"))

    async def metrics(self, request: Request) -> Response:
        return Response(self.core.metrics.render(self.core.cluster), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def state(self, request: Request) -> Response:
        msg = await cluster_state(self.core, self.policy_name)
        return JSONResponse(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))

    async def costs(self, request: Request) -> Response:
        """The backends' fitted costs as a calibration file (``unicache sim --calibration``)."""
        return JSONResponse(self.core.cluster.cost_model.to_calibration())

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    async def dashboard_history(self, request: Request) -> Response:
        return JSONResponse(self.history.to_json())

    # --- generation -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _parse(self, body: dict, chat: bool, request: Request) -> tuple[OpenAIRequest, bool]:
        """The request, and whether only a vLLM backend may take it: it has parameters this
        door does not implement and the fleet has vLLM backends to take them (relayed as
        they came: router/upstream/vllm_fleet/relay.py); else such a parameter is refused
        by name."""
        model = check_model(body, self.core.cluster.models)
        extra = unimplemented_fields(body, chat)
        if extra and not any(rec.kind == "vllm" for rec in self.core.cluster.replicas.values()):
            raise unsupported(extra[0])
        vocab = getattr(self.core.tokenizer, "vocab_size", None)
        parsed = {k: v for k, v in body.items() if k not in extra} if extra else body
        req = parse_request(parsed, chat, request.headers.get, vocab, self.max_batch_prompts)
        req.model = model
        if chat:
            req.prompts = [render_chat(body.get("messages"), self.core.tokenizer.chat_template)]
        if extra and len(req.prompts) != 1:
            raise ApiError(400, f"{extra[0]!r} is passed to vLLM for one prompt per request, not a batch", "unsupported_parameter", extra[0])
        return req, bool(extra)

    async def _generate(self, request: Request, chat: bool) -> Response:
        core = self.core
        api = "chat" if chat else "completions"
        agens: list = []
        watch: _Watch | None = None
        try:
            tenant = core.auth.authenticate(api_key_from_headers(request.headers.get))
            body = parse_body(await read_body(request, self.max_body_bytes), self.max_json_depth)
            req, passed = self._parse(body, chat, request)
            # NOTE: vLLM's rule: a completion prompt gets the tokenizer's special tokens (BOS),
            # a rendered chat template already carries them.
            token_ids = [core.encode(p, add_special_tokens=not chat) if isinstance(p, str) else p for p in req.prompts]
            preps = [core.prepare(tenant, ids, req.labels, req.model) for ids in token_ids]
            if not req.generate and not passed:
                return self._echo_only(req, token_ids, preps[0].request_id, api)
            # NOTE: one prompt goes to a vLLM backend as the client sent it, and vLLM's bytes
            # come back as they are; a batch is routed prompt by prompt and read as messages.
            # (vLLM's own path for the API, whatever root path the client reached it under)
            relay = RelayRequest(API_PATHS[chat], body, req.stream, req.include_usage, passed) if len(preps) == 1 else None
            budget = client_wait_budget_s(request.headers.get)
            agens = [core.forward(p, req.sampling, relay=relay, wait_budget_s=budget) for p in preps]
            watch = _Watch(request.scope, request.receive)
            firsts = await _first_messages(agens)
        except ClientDisconnect:
            if not request.scope.get(TIMED_OUT_SCOPE_KEY):
                log.info("client %s disconnected during its upload", _peer(request))
            self._count(api, "cancelled")
            return Response(status_code=CLIENT_CLOSED)
        except asyncio.CancelledError:
            if watch is None or not watch.caught():
                raise
            await _close_all(agens)
            self._count(api, "cancelled")
            return Response(status_code=CLIENT_CLOSED)
        except MAPPED as exc:
            if watch is not None:
                watch.close()
            await _close_all(agens)
            err = to_api_error(exc)
            self._count(api, err.outcome)
            return error_response(err)
        except BaseException:
            if watch is not None:
                watch.close()
            raise
        routes = [route for route, _ in firsts]
        headers = {
            "x-unicache-replica": ",".join(r.replica_id for r in routes),
            "x-unicache-route-reason": ",".join(r.reason for r in routes),
            "x-unicache-matched-tokens": ",".join(str(r.matched_tokens) for r in routes),
        }
        if isinstance(firsts[0][1], RelayHead):
            return await self._relayed(agens[0], firsts[0][1], watch, headers, req.stream, api)
        rid = ("chatcmpl-" if chat else "cmpl-") + preps[0].request_id
        created = int(time.time())
        echo = [self._echo_text(p, ids) for p, ids in zip(req.prompts, token_ids)] if req.echo else None
        messages = _merged(agens, firsts)
        if req.stream:
            async def close() -> None:
                await messages.aclose()
                await _close_all(agens)

            body = self._sse(req, messages, agens, rid, created, echo)
            return _EventStream(self._counted_events(body, close, api), watch, headers)
        try:
            return await self._collect(req, messages, agens, rid, created, echo, headers, api)
        except asyncio.CancelledError:
            if not watch.caught():
                raise
            self._count(api, "cancelled")
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watch.close()

    async def _relayed(self, agen, head: RelayHead, watch: _Watch, headers: dict[str, str], stream: bool, api: str) -> Response:
        """vLLM's answer as it came, with the router's headers: its events as they arrive,
        or its whole body."""
        if stream:
            return _EventStream(self._counted_events(self._relay_events(agen, head.data), agen.aclose, api), watch, headers)
        try:
            async for _ in agen:  # the call ends: its usage counted, its connection kept
                pass
        except asyncio.CancelledError:
            if not watch.caught():
                raise
            self._count(api, "cancelled")
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watch.close()
            await agen.aclose()
        self._count(api, "ok")
        return Response(head.data, media_type=head.content_type, headers=headers)

    async def _counted_events(self, body: AsyncIterator[bytes], close: Callable[[], Awaitable[None]],
                              api: str) -> AsyncIterator[bytes]:
        """``body``'s server-sent events, its outcome counted under ``api``: a failure the
        client may be told of (``MAPPED``) ends the stream with an error event and
        ``[DONE]``; an end that reaches no outcome is the client going away (Starlette
        cancels the response, or closes this generator): "cancelled", not an error.
        ``body`` and then ``close`` (what it reads from) are closed however it ends."""
        outcome = "cancelled"
        try:
            try:
                async for event in body:
                    yield event
                outcome = "ok"
            except MAPPED as exc:
                err = to_api_error(exc)
                outcome = err.outcome
                yield sse_error_event(err)
                yield b"data: [DONE]\n\n"
        except Exception:
            outcome = "error"
            raise
        finally:
            await body.aclose()
            await close()
            self._count(api, outcome)

    @staticmethod
    async def _relay_events(agen, first: bytes) -> AsyncIterator[bytes]:
        """vLLM's own event stream, relayed as it came (``first``: its first bytes)."""
        if first:
            yield first
        async for _, data in agen:
            yield data

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.core.tokenizer.decode(ids)

    def _echo_only(self, req: OpenAIRequest, token_ids: list[list[int]], request_id: str, api: str) -> Response:
        """``echo`` with ``max_tokens: 0``: the prompts back, nothing generated or routed."""
        n = req.sampling.n or 1
        usage = UsageTally(len(token_ids))
        choices = []
        for i, (p, ids) in enumerate(zip(req.prompts, token_ids)):
            usage.set_prompt(i, len(ids))
            for j in range(n):
                choices.append({"index": i * n + j, "text": self._echo_text(p, ids), "finish_reason": "length", "logprobs": None})
        rid, created = "cmpl-" + request_id, int(time.time())
        self._count(api, "ok")
        if not req.stream:
            return JSONResponse({**base(rid, created, req.model or self.model_name, chat=False, chunk=False), "choices": choices,
                                 "usage": usage.as_dict()})
        chunks = StreamChunks(rid, created, req.model or self.model_name, False, req.include_usage)
        events = [chunks.choice(c["index"], c["text"], c["finish_reason"]) for c in choices]
        if req.include_usage:
            events.append(chunks.usage(usage.as_dict()))
        events.append(b"data: [DONE]\n\n")
        return Response(b"".join(events), media_type="text/event-stream")

    async def _collect(self, req: OpenAIRequest, messages, agens, rid, created, echo, headers, api) -> Response:
        n = req.sampling.n or 1
        texts: dict[int, list[str]] = {}
        finish: dict[int, str | None] = {}
        logprobs: dict[int, Any] = {}
        usage = UsageTally(len(agens))
        want_logprobs = req.logprobs is not None
        try:
            async for i, msg in messages:
                c = i * n + msg.index
                if c not in texts:
                    texts[c] = [echo[i]] if echo else []
                    if want_logprobs:
                        logprobs[c] = [] if req.chat else CompletionLogprobs()
                texts[c].append(msg.text)
                usage.add(i, c, msg)
                if msg.finish_reason:
                    finish[c] = FINISH.get(msg.finish_reason)
                if want_logprobs:
                    if req.chat:
                        logprobs[c].extend(chat_logprobs(msg, self.token_text))
                    else:
                        logprobs[c].add(msg, self.token_text)
        except MAPPED as exc:
            err = to_api_error(exc)
            self._count(api, err.outcome)
            return error_response(err)
        finally:
            await messages.aclose()
            await _close_all(agens)
        choices = []
        for c in sorted(texts):
            text = "".join(texts[c])
            if req.chat:
                lp = {"content": logprobs[c]} if want_logprobs else None
                choices.append({"index": c, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish.get(c)})
            else:
                lp = logprobs[c].as_dict() if want_logprobs else None
                choices.append({"index": c, "text": text, "finish_reason": finish.get(c), "logprobs": lp})
        out = base(rid, created, req.model or self.model_name, req.chat, chunk=False)
        out["choices"] = choices
        out["usage"] = usage.as_dict()
        self._count(api, "ok")
        return JSONResponse(out, headers=headers)

    async def _sse(self, req: OpenAIRequest, messages, agens, rid, created, echo) -> AsyncIterator[bytes]:
        """The router's own messages as OpenAI's stream chunks, then the usage (if asked)
        and ``[DONE]``."""
        n = req.sampling.n or 1
        usage = UsageTally(len(agens))
        started: set[int] = set()
        offsets: dict[int, int] = {}
        want_logprobs = req.logprobs is not None
        events = StreamChunks(rid, created, req.model or self.model_name, req.chat, req.include_usage)
        async for i, msg in messages:
            c = i * n + msg.index
            usage.add(i, c, msg)
            text = msg.text
            first = c not in started
            if first:
                started.add(c)
                if echo:
                    text = echo[i] + text
                offsets[c] = len(text) - len(msg.text)
            lp = None
            if want_logprobs:
                if req.chat:
                    lp = {"content": chat_logprobs(msg, self.token_text)}
                else:
                    part = CompletionLogprobs(offsets[c])
                    part.add(msg, self.token_text)
                    offsets[c] = part.offset
                    lp = part.as_dict()
            yield events.choice(c, text, FINISH.get(msg.finish_reason), lp, first)
        if req.include_usage:
            yield events.usage(usage.as_dict())
        yield b"data: [DONE]\n\n"


def _internal_error() -> Response:
    return error_response(ApiError(500, "internal server error", "internal_error"))


async def _close_all(agens: list) -> None:
    for a in agens:
        await a.aclose()


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown"


