"""The replica's framed hop server: ``Generate`` for routers over ``unicache.contract.hop``.

It serves the same ``ReplicaServicer.outputs`` as the gRPC server, so both transports
stream the same messages and end with the same statuses; only the framing differs.

Invariants:
    * With a cluster key nothing but the handshake is read until the client has proved the
      key; a failed proof is answered UNAUTHENTICATED on stream 0 and the connection
      closed (counted in ``refused``).
    * Every stream ends with exactly one END or ERROR frame, unless the client cancelled
      it or the connection is gone; its task closes ``outputs`` (the engine stream) in
      every case, so a cancelled or disconnected request frees its blocks.
    * A request's deadline (from its REQUEST frame) ends it with DEADLINE_EXCEEDED.
    * Once ``stop`` began, new requests are refused UNAVAILABLE (the router retries them
      elsewhere, as it does a gRPC server's refusal), while running ones get ``grace_s``.
    * At most ``max_streams`` streams per connection; more are answered RESOURCE_EXHAUSTED
      (refusal "overloaded") without reaching the engine.
    * A protocol violation (an oversized frame, a reused live stream id, an unknown frame
      kind, a request before the handshake) closes the connection.
    * Writes wait while the connection's send buffer is over its high-water mark, so a
      client that stops reading stops the streams instead of growing memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from unicache.contract import hop
from unicache.contract.state_auth import StateAuthError
from unicache.plumbing.coalesce import CoalescingWriter
from unicache.replica.serving.call_auth import Refusals
from unicache.replica.serving.call_error import ReplicaCallError
from unicache.v1 import replica_pb2

if TYPE_CHECKING:
    from unicache.replica.serving.server import ReplicaServicer

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0


class HopServer:
    """Serves ``servicer.outputs`` on ``host:port`` (port 0 picks a free one).

    Args:
        servicer: the replica's ``ReplicaServicer``.
        host: interface to bind.
        port: port to bind (0: a free one; ``port`` reads it back after ``start``).
        cluster_key: when set, clients must complete the handshake (``unicache.contract.hop``).
        max_streams: streams one connection may have open (default 4096, like the gRPC
            server's pending limit: at least what the engine admits).
        max_message_bytes: largest frame payload accepted (default 64 MiB).
        grace_s: how long ``stop`` lets running streams finish (default 2 s).
        ssl: a TLS server context (``unicache.plumbing.tls.hop_server_context``: the router's
            client certificate required); None: plain TCP.
    """

    def __init__(
        self,
        servicer: "ReplicaServicer",
        host: str = "127.0.0.1",
        port: int = 0,
        cluster_key: bytes | None = None,
        max_streams: int = 4096,
        max_message_bytes: int = 64 * 1024 * 1024,
        grace_s: float = 2.0,
        ssl=None,  # noqa: ANN001 - ssl.SSLContext
    ):
        self.servicer = servicer
        self.ssl = ssl
        self.host = host
        self.requested_port = port
        self.port = 0
        self.auth = hop.HopAuth(cluster_key) if cluster_key else None
        self.max_streams = max_streams
        self.max_message_bytes = max_message_bytes
        self.grace_s = grace_s
        self.refusals = Refusals()
        self.streams = 0  # streams started, all connections
        self.connections: set[_HopConnection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HopConnection(self), self.host, self.requested_port, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("replica %s serving the framed hop on %s:%d", self.servicer.replica_id, self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop accepting connections, let running streams finish for ``grace_s``, then
        cancel what is left and close every connection."""
        if self._server is None:
            return
        self.stopping = True
        self._server.close()
        self._server = None
        tasks = [t for c in self.connections for t in c.streams.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace_s)
        for conn in list(self.connections):
            conn.close()
        leftover = [t for t in tasks if not t.done()]
        if leftover:
            await asyncio.wait(leftover, timeout=1.0)

    @property
    def refused(self) -> int:
        """Connections refused at the handshake (a wrong or missing cluster key)."""
        return self.refusals.count


class _HopConnection(asyncio.Protocol):
    """One client connection: the handshake, then its streams."""

    def __init__(self, server: HopServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.out: CoalescingWriter | None = None  # every frame to the router goes through it
        self.parser = hop.FrameParser(self._on_handshake_frame, hop.NONCE_BYTES + hop.PROOF_BYTES)
        self.streams: dict[int, asyncio.Task] = {}
        self.nonce = hop.new_nonce()
        self._writable: asyncio.Future | None = None  # set while the transport is paused
        self._handshake_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = CoalescingWriter(transport, asyncio.get_running_loop())
        hop.set_keepalive(transport)
        self.server.connections.add(self)
        flags = hop.FLAG_AUTH if self.server.auth is not None else 0
        self.out.write(hop.frame(hop.HELLO, 0, hop.hello_payload(flags, self.nonce, self.server.servicer.replica_id)))
        self._handshake_timer = asyncio.get_running_loop().call_later(_HANDSHAKE_TIMEOUT_S, self.close)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except hop.HopProtocolError as exc:
            log.info("hop connection closed: %s", exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        self.server.connections.discard(self)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        for task in self.streams.values():
            task.cancel()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # --- frames -------------------------------------------------------------------------
    def close(self) -> None:
        if self.out is not None:
            self.out.close()  # frames written before (a refusal) still leave

    def _on_handshake_frame(self, kind: int, sid: int, payload: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if kind != hop.AUTH or sid != 0 or len(payload) < hop.NONCE_BYTES:
            raise hop.HopProtocolError("expected the handshake's AUTH frame")
        auth = self.server.auth
        client_nonce, proof = payload[: hop.NONCE_BYTES], payload[hop.NONCE_BYTES :]
        replica_id = self.server.servicer.replica_id
        welcome = b""
        if auth is not None:
            try:
                auth.check(proof, auth.client_proof(self.nonce, client_nonce, replica_id))
            except StateAuthError as exc:
                self.server.refusals.record("a hop connection", exc)
                self.out.write(
                    hop.frame(hop.ERROR, 0, hop.encode_status(grpc.StatusCode.UNAUTHENTICATED, f"cluster credential required: {exc}"))
                )
                self.close()
                return
            welcome = auth.server_proof(self.nonce, client_nonce, replica_id)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        self.parser.on_frame = self._on_frame
        self.parser.max_payload = self.server.max_message_bytes
        self.out.write(hop.frame(hop.WELCOME, 0, welcome))

    def _on_frame(self, kind: int, sid: int, payload: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if kind == hop.REQUEST:
            self._start_stream(sid, payload)
        elif kind == hop.CANCEL:
            task = self.streams.get(sid)
            if task is not None:
                task.cancel()
        else:
            raise hop.HopProtocolError(f"unexpected frame kind {kind}")

    def _start_stream(self, sid: int, payload: bytes) -> None:
        if sid == 0 or sid in self.streams:
            raise hop.HopProtocolError(f"stream id {sid} is reserved or still open")
        if self.server.stopping:
            self._write_status(sid, grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
            return
        if len(self.streams) >= self.server.max_streams:
            self._write_status(sid, grpc.StatusCode.RESOURCE_EXHAUSTED, f"replica has {self.server.max_streams} streams open on this connection", "overloaded")
            return
        if len(payload) < hop.DEADLINE.size:
            self._write_status(sid, grpc.StatusCode.INVALID_ARGUMENT, "malformed hop request")
            return
        (deadline_ms,) = hop.DEADLINE.unpack_from(payload)
        try:
            request = replica_pb2.GenerateRequest.FromString(payload[hop.DEADLINE.size :])
        except DecodeError:
            self._write_status(sid, grpc.StatusCode.INVALID_ARGUMENT, "malformed GenerateRequest")
            return
        self.server.streams += 1
        self.streams[sid] = asyncio.get_running_loop().create_task(self._run(sid, request, deadline_ms / 1000.0 if deadline_ms else None))

    def _write_status(self, sid: int, code: grpc.StatusCode, details: str, refusal: str = "") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.out.write(hop.frame(hop.ERROR, sid, hop.encode_status(code, details, refusal)))

    async def _run(self, sid: int, request: replica_pb2.GenerateRequest, timeout_s: float | None) -> None:
        transport, write = self.transport, self.out.write
        header = hop.HEADER.pack
        try:
            async with asyncio.timeout(timeout_s), contextlib.aclosing(self.server.servicer.outputs(request)) as outputs:
                async for msg in outputs:
                    if transport.is_closing():
                        return
                    body = msg.SerializeToString()
                    write(header(hop.MESSAGE, sid, len(body)) + body)
                    if self._writable is not None and not self._writable.done():
                        await self._writable
            if not transport.is_closing():
                write(header(hop.END, sid, 0))
        except ReplicaCallError as exc:
            self._write_status(sid, exc.code, exc.details, exc.refusal)
        except TimeoutError:
            self._write_status(sid, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except asyncio.CancelledError:
            pass  # the client cancelled the stream, or the connection is gone
        except Exception as exc:  # noqa: BLE001 - never leave a stream without its status
            log.exception("hop stream %d failed", sid)
            self._write_status(sid, grpc.StatusCode.INTERNAL, f"replica failure: {exc}")
        finally:
            self.streams.pop(sid, None)
