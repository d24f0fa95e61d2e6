"""The replica hop's framed transport: frames, statuses and the handshake, shared by the
replica's hop server (``unicache.replica.serving.hop_server``) and the router's hop client
(``unicache.router.upstream.hop_client``).

Why: grpc.aio cost the router 0.799 ms of CPU per 8-token stream on the replica hop
against 0.095 ms for the same protobuf messages framed over one TCP connection
(docs/studies.md, "hop_transport"). The hop carries only ``Generate``, the request path;
probes' health service, ``GetCacheState`` and ``GetCacheSummary`` stay on gRPC.

Wire format: every frame is a 9-byte header ``kind (u8), stream id (u32), payload length
(u32)``, big-endian, then the payload. One connection multiplexes streams by id; the client
picks ids (1, 2, ...), never reusing a live one.

    server -> client  HELLO    (stream 0) ``b"UCH" || version (u8) || flags (u8) || nonce
                               (16 bytes) || replica id (UTF-8)``; flag bit 0: the server
                               holds the cluster key and requires the handshake
    client -> server  AUTH     (stream 0) ``client nonce (16) || proof (32 bytes, or none
                               when the server holds no key)``
    server -> client  WELCOME  (stream 0) the server's proof (32 bytes, or none)
    client -> server  REQUEST  ``deadline (u32 ms, 0: none) || GenerateRequest``
    client -> server  CANCEL   empty: the client gave up; the server stops the stream
    server -> client  MESSAGE  one ``GenerateResponse``
    server -> client  END      empty: the stream finished normally
    server -> client  ERROR    ``status code (u8, a gRPC code) || refusal (u8) || details``;
                               on stream 0 it ends the connection (the handshake failed)

Handshake (only with a cluster key; ``HopAuth``): both proofs are HMAC-SHA256 under a key
derived from the cluster key with its own label ("hop/v1"), over a role label, both
nonces and the replica id: ``client = H("client" || sn || cn || id)``,
``server = H("server" || sn || cn || id)``. The client proves it holds the key before the
server reads any request; the server proves it holds the key and is the replica the
client meant (the id the client expects, from the replica's signed heartbeat), so a
process squatting on an advertised port can neither read prompts nor feed tokens. Fresh
nonces on both sides make a recorded handshake useless. Frames are not encrypted, as the
gRPC hop is not.

Statuses are gRPC's codes, so both transports fail alike and the router maps them
through one table (``unicache.router.request_path.core``); a refusal byte carries
``unicache.contract.wire.REFUSAL_METADATA`` ("overloaded" / "too_large").

Invariants:
    * A frame whose payload exceeds the receiver's ``max_payload`` ends the connection
      (``HopProtocolError``); nothing past a malformed header is read.
    * No function here logs or puts the key or a proof in an exception message.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable

import grpc

from unicache.contract.state_auth import StateAuthError, derive

HEADER = struct.Struct("!BII")
HEADER_BYTES = HEADER.size
DEADLINE = struct.Struct("!I")
STATUS = struct.Struct("!BB")
MAGIC = b"UCH"
VERSION = 1
FLAG_AUTH = 1
NONCE_BYTES = 16
PROOF_BYTES = 32
MAX_REPLICA_ID_BYTES = 256

# client -> server
AUTH, REQUEST, CANCEL = 1, 2, 3
# server -> client
HELLO, WELCOME, MESSAGE, END, ERROR = 16, 17, 18, 19, 20

REFUSALS = ("", "overloaded", "too_large")  # index = the refusal byte
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_MAX_DETAILS_BYTES = 4096


class HopProtocolError(Exception):
    """The peer broke the framing or the handshake; the connection is closed."""


# TCP keepalive on every hop connection: a peer that vanished without closing (a node
# lost, a partition) is found within about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT *
# KEEPALIVE_INTERVAL_S seconds of silence, and its streams fail UNAVAILABLE instead of
# waiting for their deadlines.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def set_keepalive(transport) -> None:
    """Turn on TCP keepalive (``KEEPALIVE_*``) on ``transport``'s socket, where the
    platform has the options."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S), ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def frame(kind: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    return HEADER.pack(kind, stream_id, len(payload)) + payload


def hello_payload(flags: int, nonce: bytes, replica_id: str) -> bytes:
    return MAGIC + bytes((VERSION, flags)) + nonce + replica_id.encode()[:MAX_REPLICA_ID_BYTES]


def parse_hello(payload: bytes) -> tuple[int, bytes, str]:
    """(flags, server nonce, replica id); raises HopProtocolError for another protocol or
    version."""
    fixed = len(MAGIC) + 2 + NONCE_BYTES
    if len(payload) < fixed or payload[: len(MAGIC)] != MAGIC:
        raise HopProtocolError("the peer does not speak the unicache hop protocol")
    if payload[len(MAGIC)] != VERSION:
        raise HopProtocolError(f"hop protocol version {payload[len(MAGIC)]} (this side speaks {VERSION})")
    flags = payload[len(MAGIC) + 1]
    nonce = payload[len(MAGIC) + 2 : fixed]
    return flags, nonce, payload[fixed:].decode("utf-8", "replace")


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def encode_status(code: grpc.StatusCode, details: str, refusal: str = "") -> bytes:
    """An ERROR frame's payload; ``refusal`` is one of ``REFUSALS``."""
    return STATUS.pack(code.value[0], REFUSALS.index(refusal)) + details.encode()[:_MAX_DETAILS_BYTES]


def decode_status(payload: bytes) -> tuple[grpc.StatusCode, str, str]:
    """(code, details, refusal) of an ERROR payload; an unknown code or refusal reads as
    UNKNOWN / no refusal."""
    if len(payload) < STATUS.size:
        return grpc.StatusCode.UNKNOWN, "malformed hop status", ""
    code, refusal = STATUS.unpack_from(payload)
    details = payload[STATUS.size :].decode("utf-8", "replace")
    return _CODES.get(code, grpc.StatusCode.UNKNOWN), details, REFUSALS[refusal] if refusal < len(REFUSALS) else ""


class HopAuth:
    """The hop handshake's proofs under one cluster key (see the module docstring)."""

    __slots__ = ("_key",)

    def __init__(self, cluster_key: bytes):
        self._key = derive(cluster_key, "hop/v1")

    def __repr__(self) -> str:
        return "HopAuth(***)"

    def _proof(self, role: bytes, server_nonce: bytes, client_nonce: bytes, replica_id: str) -> bytes:
        return hmac.new(self._key, role + server_nonce + client_nonce + replica_id.encode(), hashlib.sha256).digest()

    def client_proof(self, server_nonce: bytes, client_nonce: bytes, replica_id: str) -> bytes:
        return self._proof(b"client", server_nonce, client_nonce, replica_id)

    def server_proof(self, server_nonce: bytes, client_nonce: bytes, replica_id: str) -> bytes:
        return self._proof(b"server", server_nonce, client_nonce, replica_id)

    def check(self, proof: bytes, expected: bytes) -> None:
        """Raises ``StateAuthError`` ("missing" or "bad_mac") unless ``proof`` equals
        ``expected`` (constant time)."""
        if not proof:
            raise StateAuthError("missing", "missing cluster credential")
        if not hmac.compare_digest(proof, expected):
            raise StateAuthError("bad_mac", "invalid cluster credential")


class FrameParser:
    """Splits a byte stream into frames, calling ``on_frame(kind, stream_id, payload)``
    for each complete one in order. Raises HopProtocolError for a payload longer than
    ``max_payload`` (the caller closes the connection)."""

    __slots__ = ("_buf", "max_payload", "on_frame")

    def __init__(self, on_frame: Callable[[int, int, bytes], None], max_payload: int):
        self._buf = b""
        self.max_payload = max_payload
        self.on_frame = on_frame

    def feed(self, data: bytes) -> None:
        if self._buf:
            data = self._buf + data
        n = len(data)
        pos = 0
        unpack = HEADER.unpack_from
        on_frame = self.on_frame
        while n - pos >= HEADER_BYTES:
            kind, sid, length = unpack(data, pos)
            if length > self.max_payload:
                raise HopProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_payload}")
            end = pos + HEADER_BYTES + length
            if end > n:
                break
            on_frame(kind, sid, data[pos + HEADER_BYTES : end])
            pos = end
        self._buf = data[pos:] if pos < n else b""


