"""The OpenAI-compatible HTTP front door (Starlette, served by uvicorn on the router's loop).

Routes:
    POST /v1/completions, POST /v1/chat/completions   (``stream: true`` -> server-sent
        events ending with ``data: [DONE]``; otherwise one JSON body)
    GET  /v1/models, /healthz, /readyz, /metrics, /v1/cluster/state, /dashboard

Explicit labels: body fields ``session_id``, ``task``, ``template`` (extensions) or
headers ``x-session-id``, ``x-unicache-task``, ``x-unicache-template``; body wins.
Routing is decided before the response starts, so every response (streaming too) carries
``x-unicache-replica`` and ``x-unicache-route-reason``. Errors are OpenAI-style JSON:
400 bad input, 401 bad key, 413 body over ``max_body_bytes``, 429 overload, 503 no
replicas (502/504 replica failures).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from unicache.router.auth import AuthError, api_key_from_headers
from unicache.chat_template import ChatFormatError, render_chat
from unicache.router.core import Labelled, RouterCore, RouterError
from unicache.router.dashboard import DASHBOARD_HTML
from unicache.router.cluster_state import cluster_state
from unicache.v1 import common_pb2

FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class BadRequest(ValueError):
    pass


class TooLarge(Exception):
    """The request body exceeds ``max_body_bytes`` (HTTP 413)."""


DEFAULT_MAX_BODY_BYTES = 8 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (TooLarge) as soon as it is known to exceed ``limit``:
    from ``content-length`` before reading, else while streaming it in, so an oversized
    body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


CLIENT_CLOSED = 499  # nginx's "client closed request"; never reaches the client


async def _unless_disconnected(request: Request, coro):
    """Await ``coro``, cancelling it if the client disconnects first (raises ClientGone).

    Cancelling the generation closes the replica call, so an abandoned non-streaming
    request stops computing at once. (Streaming responses get the same from Starlette.)
    """
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if task.cancelled() and watcher.done():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


def _num(body: dict, name: str, kind: type, lo: float, hi: float | None, default):
    value = body.get(name, default)
    if value is None:
        return default
    # NOTE: no float(value) on ints: a huge JSON integer would overflow it (OverflowError).
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and (math.isnan(value) or (kind is int and not value.is_integer())))
    ):
        raise BadRequest(f"{name} must be a{'n integer' if kind is int else ' number'}")
    if value < lo or (hi is not None and value > hi):
        raise BadRequest(f"{name} must be between {lo} and {hi}" if hi is not None else f"{name} must be >= {lo}")
    return kind(value)


def sampling_from_body(body: dict, chat: bool) -> common_pb2.SamplingParams:
    """OpenAI sampling fields -> proto (0 = server default, as the replica reads them)."""
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    msg = common_pb2.SamplingParams(
        max_tokens=_num({"max_tokens": max_tokens}, "max_tokens", int, 0, 2**32 - 1, 0),
        temperature=_num(body, "temperature", float, 0.0, 2.0, 0.0),
        top_p=_num(body, "top_p", float, 0.0, 1.0, 0.0),
        n=_num(body, "n", int, 1, 128, 1),
    )
    seed = body.get("seed")
    if seed is not None:
        msg.seed = _num(body, "seed", int, 0, 2**64 - 1, 0)
    stop = body.get("stop")
    if isinstance(stop, str):
        msg.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        msg.stop.extend(stop)
    elif stop is not None:
        raise BadRequest("stop must be a string or a list of strings")
    return msg


def labels_from(body: dict, request: Request) -> Labelled:
    session = body.get("session_id", request.headers.get("x-session-id"))
    task = body.get("task", request.headers.get("x-unicache-task"))
    template = body.get("template", request.headers.get("x-unicache-template"))
    if isinstance(template, str):
        if template.lower() not in ("true", "false", "1", "0"):
            raise BadRequest("template must be a boolean")
        template = template.lower() in ("true", "1")
    if template is not None and not isinstance(template, bool):
        raise BadRequest("template must be a boolean")
    if session is not None and not isinstance(session, str):
        raise BadRequest("session_id must be a string")
    if task is not None and not isinstance(task, str):
        raise BadRequest("task must be a string")
    return Labelled(session_id=session or None, task=task or None, template=template)


def usage_dict(usages: dict[int, common_pb2.Usage], completion_fallback: int) -> dict[str, Any]:
    prompt = max((u.prompt_tokens for u in usages.values()), default=0)
    cached = max((u.cached_tokens for u in usages.values()), default=0)
    completion = sum(u.completion_tokens for u in usages.values()) if usages else completion_fallback
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class HttpFrontDoor:
    """Builds the Starlette app over a ``RouterCore``."""

    def __init__(self, core: RouterCore, model_name: str, policy_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        """``max_body_bytes``: larger request bodies get 413 without being read whole (8 MiB)."""
        self.core = core
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.policy_name = policy_name
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/cluster/state", self.state, methods=["GET"]),
                Route("/dashboard", self.dashboard, methods=["GET"]),
            ]
        )

    # --- plain endpoints --------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self.core.auth.authenticate(api_key_from_headers(request.headers.get))
        except AuthError as exc:
            return error_response(401, str(exc), "invalid_api_key")
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "unicache"}]}
        )

    async def healthz(self, request: Request) -> Response:
        c = self.core.cluster
        return JSONResponse({"status": "ok", "replicas": len(c.replicas), "redis_connected": c.redis_connected})

    async def readyz(self, request: Request) -> Response:
        n = len(self.core.cluster.loads())
        return JSONResponse({"ready": n > 0, "replicas": n}, status_code=200 if n else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.core.metrics.render(self.core.cluster), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def state(self, request: Request) -> Response:
        msg = await cluster_state(self.core, self.policy_name)
        return JSONResponse(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    # --- generation -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        core = self.core
        api = "chat" if chat else "completions"
        try:
            tenant = core.auth.authenticate(api_key_from_headers(request.headers.get))
            try:
                body = json.loads(await read_body(request, self.max_body_bytes))
            except (ValueError, RecursionError):  # bad JSON or UTF-8, >4300-digit ints, deep nesting
                raise BadRequest("request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            if chat:
                token_ids = core.encode(render_chat(body.get("messages"), core.tokenizer.chat_template))
            else:
                token_ids = self._prompt_ids(body.get("prompt"))
            sampling = sampling_from_body(body, chat)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest("stream must be a boolean")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise BadRequest("stream_options must be an object")
            include_usage = bool(options.get("include_usage", False)) if stream else False
            prep = core.prepare(tenant, token_ids, labels_from(body, request))
            agen = core.forward(prep, sampling)
            route, first = await _unless_disconnected(request, agen.__anext__())
        except AuthError as exc:
            core.metrics.requests.labels(api, "unauthenticated").inc()
            return error_response(401, str(exc), "invalid_api_key")
        except TooLarge as exc:
            core.metrics.requests.labels(api, "invalid").inc()
            return error_response(413, str(exc), "payload_too_large")
        except (BadRequest, ChatFormatError) as exc:
            core.metrics.requests.labels(api, "invalid").inc()
            return error_response(400, str(exc))
        except RouterError as exc:
            core.metrics.requests.labels(api, exc.kind).inc()
            return error_response(exc.http_status, str(exc))
        except StopAsyncIteration:
            core.metrics.requests.labels(api, "upstream").inc()
            return error_response(502, "replica returned an empty stream")
        except ClientGone:
            core.metrics.requests.labels(api, "cancelled").inc()
            return Response(status_code=CLIENT_CLOSED)
        headers = {
            "x-unicache-replica": route.replica_id,
            "x-unicache-route-reason": route.reason,
            "x-unicache-matched-tokens": str(route.matched_tokens),
        }
        rid = ("chatcmpl-" if chat else "cmpl-") + prep.request_id
        created = int(time.time())
        if stream:
            body_iter = self._sse(agen, first, rid, created, chat, include_usage, api)
            return StreamingResponse(body_iter, media_type="text/event-stream", headers=headers)
        try:
            return await _unless_disconnected(request, self._collect(agen, first, rid, created, chat, headers, api))
        except ClientGone:
            core.metrics.requests.labels(api, "cancelled").inc()
            return Response(status_code=CLIENT_CLOSED)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        """A string (or a one-string list), or a list of token ids, as OpenAI accepts."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.core.encode(prompt)
        vocab = getattr(self.core.tokenizer, "vocab_size", None)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 or (vocab is not None and t >= vocab) for t in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})")
            return prompt
        raise BadRequest("prompt must be a string or a list of token ids")

    def _base(self, rid: str, created: int, chat: bool, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": self.model_name}

    async def _collect(self, agen, first, rid, created, chat, headers, api) -> Response:
        texts: dict[int, list[str]] = {}
        finish: dict[int, str | None] = {}
        usages: dict[int, common_pb2.Usage] = {}
        ntokens = 0
        try:
            msg = first
            while True:
                texts.setdefault(msg.index, []).append(msg.text)
                ntokens += len(msg.token_ids)
                if msg.finish_reason:
                    finish[msg.index] = FINISH.get(msg.finish_reason)
                if msg.HasField("usage"):
                    usages[msg.index] = msg.usage
                try:
                    _, msg = await agen.__anext__()
                except StopAsyncIteration:
                    break
        except RouterError as exc:
            self.core.metrics.requests.labels(api, exc.kind).inc()
            return error_response(exc.http_status, str(exc))
        finally:
            await agen.aclose()
        choices = []
        for i in sorted(texts):
            text = "".join(texts[i])
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish.get(i)})
            else:
                choices.append({"index": i, "text": text, "finish_reason": finish.get(i), "logprobs": None})
        body = self._base(rid, created, chat, chunk=False)
        body["choices"] = choices
        body["usage"] = usage_dict(usages, ntokens)
        self.core.metrics.requests.labels(api, "ok").inc()
        return JSONResponse(body, headers=headers)

    async def _sse(self, agen, first, rid, created, chat, include_usage, api) -> AsyncIterator[bytes]:
        usages: dict[int, common_pb2.Usage] = {}
        started: set[int] = set()
        ntokens = 0
        outcome = "error"
        try:
            msg = first
            try:
                while True:
                    ntokens += len(msg.token_ids)
                    if msg.HasField("usage"):
                        usages[msg.index] = msg.usage
                    chunk = self._base(rid, created, chat, chunk=True)
                    reason = FINISH.get(msg.finish_reason)
                    if chat:
                        delta: dict[str, Any] = {"content": msg.text}
                        if msg.index not in started:
                            delta["role"] = "assistant"
                            started.add(msg.index)
                        chunk["choices"] = [{"index": msg.index, "delta": delta, "finish_reason": reason}]
                    else:
                        chunk["choices"] = [{"index": msg.index, "text": msg.text, "finish_reason": reason, "logprobs": None}]
                    yield _sse_event(chunk)
                    try:
                        _, msg = await agen.__anext__()
                    except StopAsyncIteration:
                        break
                if include_usage:
                    chunk = self._base(rid, created, chat, chunk=True)
                    chunk["choices"] = []
                    chunk["usage"] = usage_dict(usages, ntokens)
                    yield _sse_event(chunk)
                outcome = "ok"
            except RouterError as exc:
                outcome = exc.kind
                err = {"error": {"message": str(exc), "type": ERROR_TYPES.get(exc.http_status, "error"), "param": None, "code": None}}
                yield _sse_event(err)
            yield b"data: [DONE]\n\n"
        finally:
            await agen.aclose()
            self.core.metrics.requests.labels(api, outcome).inc()


def _sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
