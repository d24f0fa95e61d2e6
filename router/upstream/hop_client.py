"""The router's side of the framed replica hop (``unicache.contract.hop``): one TCP connection per
replica, its ``Generate`` streams multiplexed on it.

``ReplicaClients`` (``unicache.router.upstream.replica_client``) sends a request here when the
replica's signed heartbeat advertises a hop address and the router's
``replica_transport`` is "auto"; everything else about the request path is the same,
because a ``HopStream`` is a ``ReplicaStream`` and fails with the same
``grpc.aio.AioRpcError`` codes a gRPC call would.

Invariants:
    * A connection carries requests only after the handshake: with a cluster key both
      sides proved it and the replica proved its id (the one the router expects from the
      heartbeat); without one the replica's id still has to match. A failed handshake
      fails the waiting streams with UNAUTHENTICATED (bad or missing proof) or UNAVAILABLE
      (another protocol, wrong id, nothing listening).
    * Every stream ends exactly once: END (EOF), ERROR (its status), its deadline
      (DEADLINE_EXCEEDED, the replica is told to stop), ``close()`` before the end (the
      replica is told to stop: CANCEL), or the connection's loss (UNAVAILABLE, every open
      stream).
    * A lost connection is replaced on the next request; requests never wait behind a
      reconnect longer than ``connect_timeout_s``.
    * A replica that leaves the cluster (its heartbeat expired) keeps its open streams:
      they end as they would on gRPC (finished, failed, or the first-token timeout), and
      the connection closes after the last one (``retire``).
    * Messages wait in their stream until read: bounded by what the replica sends for
      one request (its ``max_tokens``), as gRPC's per-stream window bounds it there.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from unicache.contract import hop
from unicache.contract.state_auth import StateAuthError
from unicache.plumbing.coalesce import CoalescingWriter
from unicache.plumbing.tls import replica_dns_name
from unicache.v1 import replica_pb2, router_pb2

from unicache.router.upstream.replica_stream import ReplicaStream, parse_replica_message, rpc_error, take_queued

log = logging.getLogger(__name__)

class HopStream(ReplicaStream):
    """One Generate on a hop connection (see ``ReplicaStream``)."""

    __slots__ = ("_client", "_conn", "_sid", "_body", "_deadline", "_items", "_waiter", "_ended", "_error", "_timer")

    def __init__(self, client: "HopClient", body: bytes, deadline: float):
        super().__init__()
        self._client = client
        self._conn: HopConnection | None = None
        self._sid = 0
        self._body = body  # the serialized GenerateRequest, until sent
        self._deadline = deadline  # loop time
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False
        self._error: grpc.aio.AioRpcError | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def _read(self) -> router_pb2.RouterGenerateResponse | None:
        if self._conn is None and not self._ended:
            # NOTE: the connect (and its handshake, TLS included) waits at most the
            # stream's own deadline: a peer that accepts and never answers must not hold
            # the request past it (the connect itself goes on for the streams after).
            remaining = self._deadline - asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    conn = await self._client.connection()
            except TimeoutError:
                self._finish(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while connecting to the replica hop"))
                raise self._error from None
            if not self._ended:  # closed while connecting
                conn.open(self)
        items = self._items
        while True:
            if items:
                return take_queued(items)
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _push(self, msg) -> None:
        self._items.append(msg)
        self._wake()

    def _finish(self, error: grpc.aio.AioRpcError | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _abandon(self, code: grpc.StatusCode, details: str) -> None:
        """End the stream here with ``code`` and tell the replica to stop it."""
        if not self._ended:
            if self._conn is not None:
                self._conn.cancel(self._sid)
            self._finish(rpc_error(code, details))

    def _expire(self) -> None:
        self._timer = None
        self._abandon(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

    def close(self) -> None:
        self._abandon(grpc.StatusCode.CANCELLED, "cancelled by the router")


class HopConnection(asyncio.Protocol):
    """One connection to a replica's hop port: the handshake, then its streams."""

    def __init__(self, client: "HopClient"):
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.out: CoalescingWriter | None = None  # REQUEST and CANCEL frames (one send per loop iteration)
        self.parser = hop.FrameParser(self._on_frame, client.max_message_bytes)
        self.streams: dict[int, HopStream] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.failed = False
        self.retiring = False  # close once the last open stream ends
        self._next_id = 1
        self._client_nonce = hop.new_nonce()
        self._server_nonce = b""

    @property
    def usable(self) -> bool:
        return not self.failed and self.transport is not None and not self.transport.is_closing()

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = CoalescingWriter(transport, asyncio.get_running_loop())
        hop.set_keepalive(transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except hop.HopProtocolError as exc:
            self.fail(grpc.StatusCode.UNAVAILABLE, f"replica hop protocol error: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        if not self.failed and self.ready.done() and not self.ready.exception():
            self.client.count("lost")  # established, and not closed by this side
            log.info("hop connection to replica %s at %s lost (%d streams open)", self.client.replica_id, self.client.address, len(self.streams))
        self.fail(grpc.StatusCode.UNAVAILABLE, "replica hop connection lost")

    # --- streams ------------------------------------------------------------------------
    def open(self, stream: HopStream) -> None:
        """Send ``stream``'s request on this connection."""
        if not self.usable:
            stream._finish(rpc_error(grpc.StatusCode.UNAVAILABLE, "replica hop connection lost"))
            return
        sid = self._next_id
        self._next_id = sid + 1 if sid < 0xFFFFFFFF else 1
        loop = asyncio.get_running_loop()
        remaining = stream._deadline - loop.time()
        if remaining <= 0:
            stream._finish(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
            return
        stream._conn, stream._sid = self, sid
        self.streams[sid] = stream
        body, stream._body = stream._body, b""
        self.out.write(hop.HEADER.pack(hop.REQUEST, sid, hop.DEADLINE.size + len(body)) + hop.DEADLINE.pack(min(int(remaining * 1000) + 1, 0xFFFFFFFF)) + body)
        stream._timer = loop.call_at(stream._deadline, stream._expire)

    def cancel(self, sid: int) -> None:
        """Tell the replica to stop stream ``sid`` (it is forgotten here at once)."""
        if self.streams.pop(sid, None) is not None and self.usable:
            self.out.write(hop.HEADER.pack(hop.CANCEL, sid, 0))
            self._close_if_retired()

    def _end(self, sid: int, error: grpc.aio.AioRpcError | None) -> None:
        """Stream ``sid`` ended at the replica (``error`` None: normally)."""
        stream = self.streams.pop(sid, None)
        if stream is not None:
            stream._finish(error)
            self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self.retiring and not self.streams:
            self.retire()

    def retire(self) -> None:
        """Close now if no stream is open, else once the last one ends (the replica left
        the cluster: its requests under way still finish or time out as they would)."""
        self.retiring = True
        if not self.streams:
            self.fail(grpc.StatusCode.UNAVAILABLE, "replica left the cluster")

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the connection: every open stream and a waiting handshake fail with ``code``."""
        if self.failed:
            return
        self.failed = True
        error = rpc_error(code, details)
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: whoever awaits it sees it; nobody may
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream._finish(error)
        if self.out is not None:
            self.out.close()  # a CANCEL written just before still leaves

    # --- frames -------------------------------------------------------------------------
    def _on_frame(self, kind: int, sid: int, payload: bytes) -> None:
        if kind == hop.MESSAGE:
            stream = self.streams.get(sid)
            if stream is not None:
                stream._push(parse_replica_message(payload))
        elif kind == hop.END:
            self._end(sid, None)
        elif kind == hop.ERROR:
            code, details, refusal = hop.decode_status(payload)
            if sid == 0:
                self.fail(code, f"replica refused the hop: {details}")
            else:
                self._end(sid, rpc_error(code, details, refusal))
        elif kind == hop.HELLO and not self._server_nonce:
            self._hello(payload)
        elif kind == hop.WELCOME and self._server_nonce and not self.ready.done():
            self._welcome(payload)
        else:
            raise hop.HopProtocolError(f"unexpected frame kind {kind}")

    def _hello(self, payload: bytes) -> None:
        flags, self._server_nonce, replica_id = hop.parse_hello(payload)
        client = self.client
        if client.replica_id and replica_id != client.replica_id:
            self.fail(grpc.StatusCode.UNAVAILABLE, f"hop peer is replica {replica_id!r}, not {client.replica_id!r}")
            return
        auth = client.auth
        if (flags & hop.FLAG_AUTH) and auth is None:
            self.fail(grpc.StatusCode.UNAUTHENTICATED, "replica requires the cluster credential; this router has no cluster key")
            return
        if auth is not None and not flags & hop.FLAG_AUTH:
            self.fail(grpc.StatusCode.UNAUTHENTICATED, "replica holds no cluster key: it cannot prove who it is")
            return
        proof = auth.client_proof(self._server_nonce, self._client_nonce, replica_id) if auth is not None else b""
        self.transport.write(hop.frame(hop.AUTH, 0, self._client_nonce + proof))

    def _welcome(self, payload: bytes) -> None:
        auth = self.client.auth
        if auth is not None:
            try:
                auth.check(payload, auth.server_proof(self._server_nonce, self._client_nonce, self.client.replica_id))
            except StateAuthError as exc:
                self.fail(grpc.StatusCode.UNAUTHENTICATED, f"replica failed to prove the cluster key: {exc}")
                return
        self.ready.set_result(self)


class HopClient:
    """The hop to one replica: its current connection, replaced when lost.

    Args:
        address: the replica's advertised hop ``host:port``.
        replica_id: the id the replica must prove ("" accepts any: tests).
        auth: the handshake's proofs (None: the replica must hold no key either).
        max_message_bytes: largest frame accepted (64 MiB, as gRPC's limit).
        connect_timeout_s: connect plus handshake (default 5 s).
        counter: a Prometheus counter labelled (outcome) counting this hop's connections:
            connected, refused (UNAUTHENTICATED handshake), unreachable, lost (None: none).
        tls: the router's mutual TLS (``unicache.plumbing.tls.ClientTls``): the connection is TLS
            and its server must prove ``replica_id`` by its certificate before anything
            is sent (a mismatch is UNAVAILABLE, unreachable); None: plain TCP.
    """

    def __init__(
        self, address: str, replica_id: str, auth: hop.HopAuth | None, max_message_bytes: int = 64 * 1024 * 1024,
        connect_timeout_s: float = 5.0, counter=None, tls=None,  # noqa: ANN001
    ):
        self.address = address
        self.tls = tls
        self.counter = counter
        self.replica_id = replica_id
        self.auth = auth
        self.max_message_bytes = max_message_bytes
        self.connect_timeout_s = connect_timeout_s
        self.connects = 0
        self._conn: HopConnection | None = None
        self._connecting: asyncio.Future | None = None

    def stream(self, request: replica_pb2.GenerateRequest, timeout_s: float) -> HopStream:
        """Start a Generate with deadline ``timeout_s``; it is sent now when the
        connection is up, else on the stream's first read after connecting."""
        loop = asyncio.get_running_loop()
        stream = HopStream(self, request.SerializeToString(), loop.time() + timeout_s)
        conn = self._conn
        if conn is not None and conn.usable:
            conn.open(stream)
        return stream

    async def connection(self) -> HopConnection:
        """The usable connection, connecting (once, for every waiter) if needed; raises
        ``grpc.aio.AioRpcError`` when it cannot."""
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> HopConnection:
        try:
            host, _, port = self.address.rpartition(":")
            loop = asyncio.get_running_loop()
            conn: HopConnection | None = None
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    secure = {}
                    if self.tls is not None:
                        secure = {"ssl": self.tls.hop_context(), "server_hostname": replica_dns_name(self.replica_id)}
                    _, conn = await loop.create_connection(lambda: HopConnection(self), host.strip("[]"), int(port), **secure)
                    await conn.ready
            except TimeoutError:
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"replica hop {self.address}: no handshake within {self.connect_timeout_s:g}s")
            except (OSError, ValueError) as exc:
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"replica hop {self.address}: {exc}")
            except grpc.aio.AioRpcError as exc:
                error = exc
            else:
                error = None
            if error is not None:
                if conn is not None:
                    conn.fail(error.code(), error.details() or "")
                self.count("refused" if error.code() == grpc.StatusCode.UNAUTHENTICATED else "unreachable")
                raise error
            self._conn = conn
            self.connects += 1
            self.count("connected")
            return conn
        finally:
            self._connecting = None

    def count(self, outcome: str) -> None:
        if self.counter is not None:
            self.counter.labels(outcome).inc()

    def close(self) -> None:
        """Fail every open stream (UNAVAILABLE) and close the connection: the router stops."""
        if self._conn is not None:
            self._conn.fail(grpc.StatusCode.UNAVAILABLE, "router closing")
            self._conn = None

    def retire(self) -> None:
        """Close the connection once its open streams have ended (``HopConnection.retire``)."""
        if self._conn is not None:
            self._conn.retire()
            self._conn = None
