"""A forwarded call as the request path sees it, whichever transport carries it
(grpc.aio: ``unicache.router.upstream.replica_client``; the framed hop:
``unicache.router.upstream.hop_client``; an HTTP request relayed to vLLM:
``unicache.router.upstream.vllm_fleet.relay``).

Invariants:
    * The replica transports (gRPC, the hop, and vLLM read for the gRPC front door) fail
      with ``grpc.aio.AioRpcError``, the codes a gRPC call would end with; the HTTP relay
      fails with ``UpstreamFailure``, which says in the request path's own terms what
      happened (a refusal, a stall, vLLM's own answer to relay) without a gRPC status.
    * A replica's ``GenerateResponse`` is read as the router's ``RouterGenerateResponse``
      (``parse_replica_message``): fields 1-5 and 7 are the same numbers, names and types
      (``tests/router/test_router_units.py`` checks it), so every field arrives and the gRPC
      front door passes the message on as its own (``route`` set on the first) without
      copying it per token.
    * ``take_queued`` hands on, as one message, the messages of one sample that arrived
      before the request path asked for them: the same tokens, text, logprobs, finish and
      usage, in order, in fewer messages (a client reads each message as a delta).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from unicache.contract.wire import REFUSAL_METADATA
from unicache.v1 import router_pb2

# The silence check runs this long before the first-token deadline it may push back.
_CHECK_AHEAD_S = 0.01

parse_replica_message = router_pb2.RouterGenerateResponse.FromString  # see the module invariants

_NO_METADATA = grpc.aio.Metadata()


def take_queued(items: collections.deque) -> router_pb2.RouterGenerateResponse:
    """The first message of non-empty ``items`` with the messages queued behind it merged
    in, as long as they continue the same sample (``index``) and it has not ended
    (finish reason or usage set): token ids and logprobs extended, text deltas
    concatenated, the last one's finish reason and usage kept. The merged messages leave
    ``items``; a message of another sample, or any after a sample's end, stays.

    Why: a request path that falls behind its replica (a loaded router, a replica that
    emits several tokens at once) then pays its per-message costs (a front-door write, an
    SSE event, a gRPC message) once per batch instead of once per token, as vLLM's
    output collector merges what a slow consumer has not read yet. Nothing waits for a
    merge: only what already arrived is taken.
    """
    msg = items.popleft()
    while items and not msg.finish_reason and not msg.HasField("usage") and items[0].index == msg.index:
        nxt = items.popleft()
        msg.token_ids.extend(nxt.token_ids)
        if nxt.text:
            msg.text += nxt.text
        if nxt.logprobs:
            msg.logprobs.extend(nxt.logprobs)
        if nxt.finish_reason:
            msg.finish_reason = nxt.finish_reason
        if nxt.HasField("usage"):
            msg.usage.CopyFrom(nxt.usage)
    return msg


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """A backend's own HTTP answer, passed to an HTTP client as it is."""

    status: int
    content_type: str
    body: bytes


class UpstreamFailure(Exception):
    """A call that failed before or while streaming, in the request path's terms.

    Args:
        kind: the ``RouterError`` kind the client's error takes (invalid, overloaded,
            unavailable, upstream, deadline).
        message: what the client may be told (names no address).
        refused: the backend did no work (nothing connected, or it refused): quarantined,
            and another backend tried without using up the retry budget.
        stalled: it was silent past its first-token timeout or the deadline: quarantined.
        retryable: worth another backend when nothing was sent to the client yet.
        answer: the backend's own HTTP answer, relayed to an HTTP client unchanged.
        detail: what happened, for the log only.
    """

    def __init__(self, kind: str, message: str, *, refused: bool = False, stalled: bool = False, retryable: bool = True,
                 answer: UpstreamAnswer | None = None, detail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.detail = detail or message
        self.refused = refused
        self.stalled = stalled
        self.retryable = retryable or refused
        self.answer = answer


def rpc_error(code: grpc.StatusCode, details: str, refusal: str = "") -> grpc.aio.AioRpcError:
    """The ``AioRpcError`` a gRPC call ending with this status raises (a refusal as the
    trailing metadata the replica's gRPC servicer sends, ``unicache.contract.wire.REFUSAL_METADATA``)."""
    trailing = grpc.aio.Metadata((REFUSAL_METADATA, refusal)) if refusal else _NO_METADATA
    return grpc.aio.AioRpcError(code, _NO_METADATA, trailing, details=details)


class ReplicaStream:
    """One forwarded call: ``first()``, then ``next()`` until None; ``close()`` it in a
    finally. Failures raise ``grpc.aio.AioRpcError`` (gRPC, the framed hop in
    ``unicache.router.upstream.hop_client``) or ``UpstreamFailure`` (the HTTP relay).
    Subclasses implement ``_read`` (the next message, None at the end) and ``close``."""

    __slots__ = ("timed_out",)

    def __init__(self) -> None:
        self.timed_out = False  # first() gave up waiting (the replica stalled)

    async def _read(self) -> router_pb2.RouterGenerateResponse | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _silence_error(self, timeout_s: float) -> BaseException:
        """What ``first`` raises when the backend stayed silent past ``timeout_s``."""
        return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"replica silent for {timeout_s:g}s before the first token")

    async def first(
        self, timeout_s: float | None = None, last_progress: Callable[[], float] | None = None, max_wait_s: float | None = None
    ) -> router_pb2.RouterGenerateResponse | None:
        """The first message (None if the stream ended empty); raises grpc.aio.AioRpcError.

        With ``timeout_s``, a replica that stays silent that long is cancelled and the
        call fails with DEADLINE_EXCEEDED (``timed_out`` set). Silence counts from the
        later of this call's start and ``last_progress()`` (``time.monotonic`` of the
        replica's last message on any stream): a replica streaming to others is busy,
        not stalled. ``max_wait_s`` bounds the wait in any case.
        """
        if timeout_s is None:
            return await self._read()
        # NOTE: asyncio.timeout_at cancels this task at the deadline (the read is then
        # cancelled), with no extra task per request; a check just before the deadline
        # pushes it back while the replica keeps sending to other streams.
        loop = asyncio.get_running_loop()
        started = loop.time()  # time.monotonic() on the default loop, as last_progress

        def due() -> float:
            quiet_since = max(started, last_progress()) if last_progress is not None else started
            at = quiet_since + timeout_s
            return min(at, started + max_wait_s) if max_wait_s is not None else at

        handle = None
        try:
            async with asyncio.timeout_at(due()) as cm:

                def check() -> None:
                    nonlocal handle
                    at = due()
                    if at > cm.when():  # it spoke meanwhile: wait for silence again
                        cm.reschedule(at)
                        handle = loop.call_at(at - _CHECK_AHEAD_S, check)

                handle = loop.call_at(cm.when() - _CHECK_AHEAD_S, check)
                return await self._read()
        except TimeoutError:
            self.timed_out = True
            self.close()
            raise self._silence_error(timeout_s) from None
        finally:
            if handle is not None:
                handle.cancel()

    async def next(self) -> router_pb2.RouterGenerateResponse | None:
        """The next message, or None once the replica ended the stream."""
        return await self._read()
