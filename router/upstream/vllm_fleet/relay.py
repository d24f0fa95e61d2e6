"""An OpenAI HTTP request relayed to a vLLM backend: the client's own body in, vLLM's own
bytes out.

The HTTP front door hands the request path a ``RelayRequest`` (the client's path and
body); when the chosen backend is a vLLM server the request path opens a ``VllmRelay``
instead of a protobuf ``Generate``. What vLLM receives (``relay_body``): the client's
body with the model renamed to the backend's served name, the tenant salt as
``cache_salt``, the request class in ``vllm_xargs`` (UniCache's scheduler reads it from
``SamplingParams.extra_args``) and, on a stream, ``stream_options.include_usage``. What
the client receives: vLLM's server-sent events (or its JSON body) byte for byte, with the
router's headers. The router reads only the arrival of the first bytes (the first token:
time to first token, the first-token timeout) and the final usage (cached and computed
tokens for the metrics), found by a byte search for ``"usage":`` instead of decoding
every chunk.

Invariants:
    * Failures raise ``UpstreamFailure``, never a gRPC status: no connection, a connection
      lost before the answer, or 502/503/504 are refusals (the request path quarantines
      the backend and tries another); any other status is vLLM's answer, relayed to the
      client as it is (status, content type, body) unless a 5xx is retried elsewhere first.
    * A usage chunk the client did not ask for (the router asked for it) is cut out of
      the relayed bytes; one it asked for is relayed untouched.
    * ``close`` before the end closes the connection, so vLLM aborts the request and frees
      its blocks; the deadline does the same.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import msgspec

from unicache.contract.vllm_events import EXTRA_ARGS_KEY, class_to_vllm, salt_to_vllm
from unicache.router.upstream.replica_stream import ReplicaStream, UpstreamAnswer, UpstreamFailure
from unicache.router.upstream.vllm_fleet.http_pool import HttpError, HttpPool, HttpResponse
from unicache.v1 import common_pb2

_REFUSED = frozenset({502, 503, 504})
_USAGE = b'"usage":'
_MAX_ERROR_BODY = 64 * 1024
_encode = msgspec.json.Encoder().encode
_decoder = json.JSONDecoder()


@dataclass(slots=True)
class RelayRequest:
    """An HTTP client's request as it may be relayed to a vLLM backend.

    ``only_vllm``: it has parameters only vLLM interprets, so only vLLM backends may take
    it; ``client_usage``: the client asked for the usage chunk (``stream_options``)."""

    path: str
    body: dict
    stream: bool
    client_usage: bool = False
    only_vllm: bool = False


@dataclass(slots=True)
class RelayHead:
    """The first bytes of a relayed answer (the whole body when it is not streamed)."""

    content_type: str
    data: bytes


def relay_body(req: RelayRequest, model: str, salt: bytes, request_class: common_pb2.RequestClass) -> bytes:
    """What the backend receives for ``req`` (see the module docstring)."""
    body = req.body
    out = {**body, "model": model} if model else dict(body)
    salt_hex = salt_to_vllm(salt)
    if salt_hex:
        out["cache_salt"] = salt_hex
    xargs = dict(body.get("vllm_xargs") or {})
    xargs[EXTRA_ARGS_KEY] = class_to_vllm(request_class)
    out["vllm_xargs"] = xargs
    if req.stream and not req.client_usage:
        out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return _encode(out)


def read_usage(data: bytes, at: int) -> dict | None:
    """The JSON object after the ``"usage":`` at ``at`` in ``data`` (None: null or not one)."""
    text = data[at + len(_USAGE):].decode("utf-8", "replace").lstrip()
    try:
        value, _ = _decoder.raw_decode(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# What the client is told when no answer of vLLM's is relayed (the detail, which may name
# an address, goes to the log only).
_CLIENT = {"unavailable": "replica unavailable", "deadline": "replica did not answer in time", "upstream": "replica failed"}


def _failure(kind: str, detail: str, *, refused: bool = False, stalled: bool = False, retryable: bool = True,
             answer: UpstreamAnswer | None = None) -> UpstreamFailure:
    return UpstreamFailure(kind, _CLIENT.get(kind, "replica failed"), refused=refused, stalled=stalled, retryable=retryable,
                           answer=answer, detail=detail)


def status_failure(status: int, content_type: str, body: bytes) -> UpstreamFailure:
    """vLLM's non-200 answer before anything was relayed (see the module invariants)."""
    if status in _REFUSED:
        return _failure("unavailable", f"backend answered {status}", refused=True)
    answer = UpstreamAnswer(status, content_type or "application/json", body)
    if status == 429:
        return _failure("overloaded", f"backend answered {status}", retryable=False, answer=answer)
    if status >= 500:
        return _failure("upstream", f"backend answered {status}", answer=answer)
    return _failure("invalid", f"backend answered {status}", retryable=False, answer=answer)


class BackendCall(ReplicaStream):
    """An HTTP call to a vLLM backend as the request path streams it: its response, one
    deadline for the whole call (the open under ``asyncio.timeout_at``, then a single timer
    that fails the body's reads, not a timeout per read), and ``close`` closing an
    unfinished response's connection, so vLLM aborts the request and frees its blocks."""

    __slots__ = ("_pool", "_deadline", "_response", "_timer", "_done")

    DEADLINE = "deadline"  # the HttpError message the timer fails reads with

    def __init__(self, pool: HttpPool, timeout_s: float):
        super().__init__()
        self._pool = pool
        self._deadline = time.monotonic() + timeout_s
        self._response: HttpResponse | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done = False

    def _until_deadline(self):
        """The ``asyncio.timeout_at`` of the call's deadline (for its open)."""
        loop = asyncio.get_running_loop()
        return asyncio.timeout_at(loop.time() + self._deadline - time.monotonic())

    def _arm(self) -> None:
        """Start the deadline timer of the body's reads."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + self._deadline - time.monotonic(), self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self._response is not None and not self._done:
            self._response._fail(HttpError(self.DEADLINE, sent=True))

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._response is not None:
            self._response.close()

    def close(self) -> None:
        if not self._done:
            self._finish()


class VllmRelay(BackendCall):
    """One relayed request (see the module docstring): ``first()`` is a ``RelayHead``, every
    later message the bytes that arrived since; ``usage`` is vLLM's final usage (a dict)
    once the stream ended."""

    __slots__ = ("_path", "_body", "_stream", "_strip", "usage", "_carry")

    def __init__(self, pool: HttpPool, req: RelayRequest, body: bytes, timeout_s: float):
        super().__init__(pool, timeout_s)
        self._path = req.path
        self._body = body
        self._stream = req.stream
        self._strip = req.stream and not req.client_usage
        self._carry = b""  # a usage event cut by a read boundary, held until its end arrives
        self.usage: dict | None = None

    def _silence_error(self, timeout_s: float) -> BaseException:
        return _failure("deadline", f"backend silent for {timeout_s:g}s before the first token", stalled=True)

    async def _read(self):
        if self._done:
            return None
        if self._response is None:
            return await self._open()
        try:
            data = await self._response.chunk()
        except HttpError as exc:
            self.close()
            raise _failure("deadline" if str(exc) == self.DEADLINE else "unavailable", f"backend connection lost mid-stream ({exc})") from None
        if data is None:
            self._finish()
            return self._flush()
        return self._scan(data)

    async def _open(self) -> RelayHead:
        try:
            async with self._until_deadline():
                response = self._response = await self._pool.request("POST", self._path, self._body)
                if response.status != 200:
                    body = await response.read() if self._limited(response) else b""
                    self.close()
                    raise status_failure(response.status, response.headers.get("content-type", ""), body[:_MAX_ERROR_BODY])
                if not self._stream:
                    data = await response.read()
                    self._finish()
                    self._note_usage(data, data.rfind(_USAGE))
                    return RelayHead(response.headers.get("content-type", "application/json"), data)
                data = await response.chunk()
        except TimeoutError:
            self.close()
            raise _failure("deadline", "backend did not answer within the deadline", stalled=True) from None
        except HttpError as exc:
            self.close()
            raise _failure("unavailable", f"backend unreachable ({exc})", refused=True) from None
        if data is None:
            self._finish()
            data = b""
        else:
            self._arm()
            data = self._scan(data)
        return RelayHead(response.headers.get("content-type", "text/event-stream"), data)

    @staticmethod
    def _limited(response: HttpResponse) -> bool:
        length = response.headers.get("content-length", "")
        return not length.isdigit() or int(length) <= _MAX_ERROR_BODY

    def _scan(self, data: bytes) -> bytes:
        """``data`` as the client gets it: whole events only (an event a read boundary cut
        waits for its end), the usage event noted, and cut out when the client did not
        ask for it."""
        if self._carry:
            data, self._carry = self._carry + data, b""
        if not data.endswith(b"\n\n"):
            # NOTE: vLLM writes one event per chunk, so this is rare; it keeps a usage event
            # split across reads from passing unseen.
            last = data.rfind(b"\n\n") + 2
            data, self._carry = data[:last], data[last:]
        at = data.rfind(_USAGE)
        if at < 0:
            return data
        start = data.rfind(b"data:", 0, at)
        if start < 0:  # not an event: nothing to cut
            self._note_usage(data, at)
            return data
        end = data.find(b"\n\n", at) + 2
        self._note_usage(data[start:end], at - start)
        return data[:start] + data[end:] if self._strip else data

    def _flush(self) -> bytes | None:
        carry, self._carry = self._carry, b""
        return carry or None

    def _note_usage(self, data: bytes, at: int) -> None:
        if at >= 0:
            usage = read_usage(data, at)
            if usage is not None:
                self.usage = usage
