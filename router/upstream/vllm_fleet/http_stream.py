"""A forwarded ``Generate`` to a stock vLLM OpenAI server, read as messages:
``/v1/completions`` over HTTP for the gRPC front door (and a batch of prompts on the HTTP
door), and the vLLM backends' HTTP clients (``VllmClients``).

An HTTP client's single request is not read here: it is relayed as it is
(``unicache.router.upstream.vllm_fleet.relay``). The gRPC front door needs protobuf
messages, so this stream reads vLLM's server-sent events and hands on
``RouterGenerateResponse`` messages, and raises ``grpc.aio.AioRpcError`` with the codes a
replica's gRPC call would end with, as every transport the gRPC door reaches does.

What vLLM receives (``completion_body``): the prompt as the token ids the router hashed
(so what vLLM caches is exactly what the router indexed), the sampling parameters, the
tenant salt as ``cache_salt`` (hex) and the request class as ``vllm_xargs`` (UniCache's
scheduler reads it from ``SamplingParams.extra_args``), ``return_token_ids`` and
``stream_options.include_usage``.

Invariants:
    * Error codes: no connection, or 502/503/504 -> UNAVAILABLE (a refusal: retried
      elsewhere, the backend quarantined); 400/404/422 -> INVALID_ARGUMENT with vLLM's own
      message (the request's fault); 429 -> RESOURCE_EXHAUSTED; any other status or a
      malformed stream -> INTERNAL; the deadline -> DEADLINE_EXCEEDED.
    * ``close`` before the end closes the HTTP connection, so vLLM aborts the request and
      frees its blocks (as a cancelled gRPC call does).
    * Usage arrives on the last message (index 0), ``cached_tokens`` from vLLM's
      ``prompt_tokens_details`` (vLLM reports it with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc

from unicache.contract.vllm_events import EXTRA_ARGS_KEY, class_to_vllm, salt_to_vllm
from unicache.router.upstream.replica_stream import rpc_error
from unicache.router.upstream.vllm_fleet.http_pool import HttpError, HttpPool
from unicache.router.upstream.vllm_fleet.relay import BackendCall, RelayRequest, VllmRelay, relay_body
from unicache.v1 import common_pb2, replica_pb2, router_pb2


_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_REFUSED = frozenset({502, 503, 504})
_CALLERS_FAULT = frozenset({400, 404, 422})


def completion_body(model: str, request: replica_pb2.GenerateRequest) -> dict:
    """vLLM's ``/v1/completions`` body for ``request`` (see the module docstring)."""
    s = request.sampling
    body: dict = {
        "model": model,
        "prompt": list(request.token_ids.ids),
        "temperature": s.temperature,
        "top_p": s.top_p or 1.0,
        "n": s.n or 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "vllm_xargs": {EXTRA_ARGS_KEY: class_to_vllm(request.request_class)},
    }
    # NOTE: max_tokens 0 means "the server's default"; vLLM's (None) runs to the context.
    if s.max_tokens:
        body["max_tokens"] = s.max_tokens
    elif not s.fill_context:
        body["max_tokens"] = 16
    if s.HasField("seed"):
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.HasField("logprobs"):
        body["logprobs"] = s.logprobs
        body["return_tokens_as_token_ids"] = True
    salt = salt_to_vllm(request.cache_salt)
    if salt:
        body["cache_salt"] = salt
    if request.adapter_id:
        body["model"] = request.adapter_id  # vLLM serves a LoRA adapter under its own name
    return body


def _error_message(raw: bytes, status: int) -> str:
    """vLLM's OpenAI-shaped error message, else the status."""
    try:
        err = json.loads(raw)
        msg = err.get("error", {}).get("message") if isinstance(err.get("error"), dict) else err.get("message")
        if msg:
            return str(msg)[:500]
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}"


def _status_error(status: int, raw: bytes) -> grpc.aio.AioRpcError:
    message = _error_message(raw, status)
    if status in _REFUSED:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"backend answered {status}: {message}")
    if status in _CALLERS_FAULT:
        return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, message)
    if status == 429:
        return rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    return rpc_error(grpc.StatusCode.INTERNAL, f"backend answered {status}: {message}")


def _logprobs(lp: dict, msg: router_pb2.RouterGenerateResponse) -> None:
    """vLLM's completion logprobs (tokens as ``token_id:N``) as ``TokenLogprobs``."""
    tops = lp.get("top_logprobs") or []
    for i, value in enumerate(lp.get("token_logprobs") or []):
        entry = msg.logprobs.add(logprob=float(value if value is not None else 0.0))
        top = tops[i] if i < len(tops) and tops[i] else {}
        for key, top_lp in sorted(top.items(), key=lambda kv: -kv[1]):
            _, _, tid = str(key).rpartition(":")
            if tid.isdigit():
                entry.top.add(token_id=int(tid), logprob=float(top_lp))


def parse_chunk(data: dict) -> list[router_pb2.RouterGenerateResponse]:
    """One streamed vLLM completion chunk as our messages (one per choice, plus one for a
    usage-only chunk)."""
    out = []
    for choice in data.get("choices") or ():
        msg = router_pb2.RouterGenerateResponse(index=int(choice.get("index", 0)), text=choice.get("text") or "")
        msg.token_ids.extend(choice.get("token_ids") or ())
        finish = choice.get("finish_reason")
        if finish:
            msg.finish_reason = _FINISH.get(finish, common_pb2.FINISH_REASON_STOP)
        if choice.get("logprobs"):
            _logprobs(choice["logprobs"], msg)
        out.append(msg)
    usage = data.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        msg = router_pb2.RouterGenerateResponse(index=0)
        msg.usage.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        msg.usage.completion_tokens = int(usage.get("completion_tokens") or 0)
        msg.usage.cached_tokens = int(details.get("cached_tokens") or 0)
        out.append(msg)
    return out


class VllmHttpStream(BackendCall):
    """One ``/v1/completions`` call read as messages (see the module docstring)."""

    __slots__ = ("_body", "_buffer", "_pending")

    def __init__(self, pool: HttpPool, body: dict, timeout_s: float):
        super().__init__(pool, timeout_s)
        self._body = json.dumps(body, separators=(",", ":")).encode()
        self._buffer = b""
        self._pending: list[router_pb2.RouterGenerateResponse] = []

    async def _open(self) -> None:
        try:
            async with self._until_deadline():
                self._response = await self._pool.request("POST", "/v1/completions", self._body)
                if self._response.status != 200:
                    raw = await self._response.read()
                    self.close()
                    raise _status_error(self._response.status, raw)
        except TimeoutError:
            self.close()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "backend did not answer in time") from None
        except HttpError as exc:
            self.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"backend unreachable: {exc}") from None
        self._arm()

    async def _event(self) -> dict | None:
        """The next ``data:`` event's JSON; None after ``[DONE]`` or at the body's end."""
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                chunk = await self._response.chunk()
                if chunk is None:
                    return None
                self._buffer += chunk
                continue
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        await self._response.read()  # to its end: the connection is kept
                        return None
                    return json.loads(data)

    async def _read(self) -> router_pb2.RouterGenerateResponse | None:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            return None
        if self._response is None:
            await self._open()
        try:
            while True:
                chunk = await self._event()
                if chunk is None:
                    self._finish()
                    return None
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    raise rpc_error(grpc.StatusCode.INTERNAL, f"backend failed mid-stream: {err.get('message') if isinstance(err, dict) else err}")
                msgs = parse_chunk(chunk)
                if msgs:
                    self._pending.extend(msgs[1:])
                    return msgs[0]
        except HttpError as exc:
            self.close()
            if str(exc) == self.DEADLINE:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "backend did not finish within the deadline") from None
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"backend connection lost: {exc}") from None
        except ValueError:
            self.close()
            raise rpc_error(grpc.StatusCode.INTERNAL, "backend sent a malformed event stream") from None
        except grpc.aio.AioRpcError:
            self.close()
            raise


@dataclass(slots=True, frozen=True)
class PolledAnswer:
    """A backend's whole answer to one of the router's own GETs (``/health``,
    ``/v1/models``, ``/metrics``)."""

    status: int
    content_type: str
    body: bytes


class BackendUnreachable(Exception):
    """A poll got no answer: no connection, a connection lost, or its deadline passed;
    the message says which."""


class VllmClients:
    """HTTP clients of the vLLM backends, by base URL, with each one's served model name:
    requests and the followers' polls (``get``) share each backend's ``HttpPool``
    (``pool``).

    Args:
        max_connections: connections kept per backend (default 256).
    """

    def __init__(self, max_connections: int = 256):
        self.max_connections = max_connections
        self._pools: dict[str, HttpPool] = {}
        self.models: dict[str, str] = {}  # base URL -> the model name it serves

    def pool(self, url: str) -> HttpPool:
        """The request connections of the backend at ``url``."""
        p = self._pools.get(url)
        if p is None:
            p = self._pools[url] = HttpPool(url, self.max_connections)
        return p

    def relay(self, url: str, req: RelayRequest, adapter: str, salt: bytes, request_class: common_pb2.RequestClass,
              timeout_s: float) -> VllmRelay:
        """Relay an HTTP client's request to the backend at ``url`` (``adapter``: the LoRA
        adapter it names, sent as the model; else the backend's served model)."""
        body = relay_body(req, adapter or self.models.get(url, ""), salt, request_class)
        return VllmRelay(self.pool(url), req, body, timeout_s)

    async def get(self, url: str, path: str, timeout_s: float) -> PolledAnswer:
        """GET ``path`` of the backend at ``url``, read whole within ``timeout_s``; raises
        ``BackendUnreachable`` when no answer came."""
        r = None
        try:
            async with asyncio.timeout(timeout_s):
                r = await self.pool(url).request("GET", path)
                body = await r.read()
        except HttpError as exc:
            raise BackendUnreachable(str(exc)) from None
        except TimeoutError:
            raise BackendUnreachable(f"no answer within {timeout_s:g}s") from None
        finally:
            if r is not None:
                r.close()
        return PolledAnswer(r.status, r.headers.get("content-type", ""), body)

    def generate(self, url: str, request: replica_pb2.GenerateRequest, timeout_s: float) -> VllmHttpStream:
        model = self.models.get(url, "")
        return VllmHttpStream(self.pool(url), completion_body(model, request), timeout_s)

    async def probe(self, url: str, timeout_s: float) -> None:
        """vLLM's ``/health``; raises ``AioRpcError(UNAVAILABLE)`` unless it answers 200."""
        try:
            answer = await self.get(url, "/health", timeout_s)
        except BackendUnreachable as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"backend health check failed: {exc}") from None
        if answer.status != 200:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"backend health check answered {answer.status}")

    async def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
