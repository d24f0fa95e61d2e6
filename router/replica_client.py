"""gRPC clients for the replicas: one ``grpc.aio`` channel per address, reused.

Invariants:
    * Every forwarded ``Generate`` carries a deadline (the request's remaining time, at
      most ``forward_deadline_s``); every probe has its own.
    * With a ``CallCredential`` every call carries the cluster credential
      (``x-unicache-cluster-auth``); replicas refuse calls without it (UNAUTHENTICATED).
    * ``ReplicaStream`` cancels the replica call when it is closed before the replica
      finished (client went away, router shutting down), so the replica frees the
      request's blocks.
    * A replica's ``GenerateResponse`` is read as the router's ``RouterGenerateResponse``
      (``parse_replica_message``): fields 1-5 and 7 are the same numbers, names and types
      (``tests/test_router_units.py`` checks it), so every field arrives and the gRPC
      front door passes the message on as its own (``route`` set on the first) without
      copying it per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from unicache.state_auth import CallCredential
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2

# Status codes that mean "this replica could not serve it", worth one retry elsewhere
# when nothing was streamed yet. INVALID_ARGUMENT and RESOURCE_EXHAUSTED are the
# request's fault and would fail anywhere.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


# The silence check runs this long before the first-token deadline it may push back.
_CHECK_AHEAD_S = 0.01

GENERATE_METHOD = "/unicache.v1.Replica/Generate"
parse_replica_message = router_pb2.RouterGenerateResponse.FromString  # see the module invariants

PROBE_REQUEST_ID = "router-probe"
_PROBE = replica_pb2.GenerateRequest(
    request_id=PROBE_REQUEST_ID, token_ids=replica_pb2.TokenIds(ids=[0]), sampling=common_pb2.SamplingParams(max_tokens=1)
)


class ReplicaStream:
    """One forwarded Generate call: ``first()``, then ``next()`` until None; ``close()`` it
    in a finally."""

    __slots__ = ("_call", "_done", "timed_out")

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call
        self._done = False
        self.timed_out = False  # first() gave up waiting (the replica stalled)

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
            msg = await self._call.read()
        else:
            # NOTE: asyncio.timeout_at cancels this task at the deadline (grpc then cancels the
            # call), with no extra task per request; a check just before the deadline
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
                    msg = await self._call.read()
            except TimeoutError:
                self.timed_out = True
                self.close()
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details=f"replica silent for {timeout_s:g}s before the first token",
                ) from None
            finally:
                if handle is not None:
                    handle.cancel()
        if msg is grpc.aio.EOF:
            self._done = True
            return None
        return msg

    async def next(self) -> router_pb2.RouterGenerateResponse | None:
        """The next message, or None once the replica ended the stream."""
        msg = await self._call.read()
        if msg is grpc.aio.EOF:
            self._done = True
            return None
        return msg

    def close(self) -> None:
        if not self._done:
            self._call.cancel()
            self._done = True


class ReplicaClients:
    """Channels to replicas keyed by address.

    Args:
        forward_deadline_s: deadline of each forwarded Generate (default 300 s).
        max_message_bytes: send/receive limit (64 MiB, like the replica server).
        credential: the cluster credential every call carries (None: none, for replicas
            started without a cluster key).
    """

    def __init__(
        self,
        forward_deadline_s: float = 300.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        credential: CallCredential | None = None,
    ):
        self.forward_deadline_s = forward_deadline_s
        self.credential = credential
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channels: dict[str, tuple[grpc.aio.Channel, replica_pb2_grpc.ReplicaStub, grpc.aio.UnaryStreamMultiCallable]] = {}

    def _entry(self, address: str):
        entry = self._channels.get(address)
        if entry is None:
            entry = self._channels[address] = self._connect(address, self._options)
        return entry

    @staticmethod
    def _connect(address: str, options: list):
        """(channel, stub, Generate multicallable reading ``parse_replica_message``)."""
        channel = grpc.aio.insecure_channel(address, options=options)
        generate = channel.unary_stream(
            GENERATE_METHOD, request_serializer=replica_pb2.GenerateRequest.SerializeToString,
            response_deserializer=parse_replica_message,
        )
        return channel, replica_pb2_grpc.ReplicaStub(channel), generate

    def stub(self, address: str) -> replica_pb2_grpc.ReplicaStub:
        return self._entry(address)[1]

    def generate(self, address: str, request: replica_pb2.GenerateRequest, timeout_s: float | None = None) -> ReplicaStream:
        """Start a Generate with deadline ``timeout_s`` (default and bound ``forward_deadline_s``);
        its messages are ``RouterGenerateResponse`` (see the module invariants)."""
        deadline = self.forward_deadline_s if timeout_s is None else min(timeout_s, self.forward_deadline_s)
        return ReplicaStream(self._entry(address)[2](request, timeout=deadline, metadata=self._metadata()))

    async def probe(self, address: str, timeout_s: float) -> None:
        """A one-token Generate (one prompt token, no full block, so nothing is cached or
        published) that must send its first message within ``timeout_s``: can the replica
        serve now? Raises grpc.aio.AioRpcError when it cannot."""
        stream = self.generate(address, _PROBE, timeout_s)
        try:
            await stream.first()
        finally:
            stream.close()

    async def cache_state(self, address: str, timeout_s: float):
        """The replica's ``GetCacheState`` (raises grpc.aio.AioRpcError after ``timeout_s``)."""
        return await self.stub(address).GetCacheState(
            replica_pb2.GetCacheStateRequest(), timeout=timeout_s, metadata=self._metadata()
        )

    async def cache_summary(self, address: str, nonce: bytes, timeout_s: float) -> bytes:
        """The replica's sealed ``GetCacheSummary`` answer for ``nonce`` (the subscriber
        verifies it); raises grpc.aio.AioRpcError after ``timeout_s``."""
        resp = await self.stub(address).GetCacheSummary(
            replica_pb2.GetCacheSummaryRequest(nonce=nonce), timeout=timeout_s, metadata=self._metadata()
        )
        return resp.signed_summary

    def _metadata(self):
        return self.credential.metadata() if self.credential is not None else None

    async def close(self) -> None:
        channels = [entry[0] for entry in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
