"""Clients for the replicas: one ``grpc.aio`` channel per address, reused, and one framed
hop connection (``unicache.router.upstream.hop_client``) per replica that advertises one.

Invariants:
    * A replica whose address is an HTTP base URL is a stock vLLM server
      (``unicache.router.upstream.vllm_fleet``): its ``generate`` is a ``/v1/completions`` call and
      its probe a ``/health``.
    * ``generate`` goes over the framed hop when the replica's heartbeat advertises a hop
      address and ``transport`` is "auto"; otherwise (and for every other call: probes of
      replicas without a hop, ``GetCacheState``, ``GetCacheSummary``) over gRPC.
    * Every forwarded ``Generate`` carries a deadline (the request's remaining time, at
      most ``forward_deadline_s``); every probe has its own.
    * With mutual TLS (``tls``) every connection, either transport, proves the replica
      id the call is for by its certificate before a byte of the call is sent, and the
      router's client certificate is required; no bearer credential is sent. Without
      TLS, with a cluster key every call is authenticated: gRPC calls carry the cluster
      credential (``x-unicache-cluster-auth``), hop connections complete the mutual
      handshake (``unicache.contract.hop``); replicas refuse anything else (UNAUTHENTICATED).
    * A ``ReplicaStream`` cancels the replica call when it is closed before the replica
      finished (client went away, router shutting down), so the replica frees the
      request's blocks.
    * Messages are read as ``RouterGenerateResponse`` (``unicache.router.upstream.replica_stream``).
"""

from __future__ import annotations

import asyncio

import grpc

from unicache.contract.hop import HopAuth
from unicache.contract.state_auth import CallCredential
from unicache.plumbing.grpc_server import keepalive_channel_options
from unicache.plumbing.tls import grpc_channel_options
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2

from unicache.router.upstream.hop_client import HopClient
from unicache.router.upstream.replica_stream import ReplicaStream, parse_replica_message
from unicache.router.upstream.vllm_fleet.http_stream import VllmClients

TRANSPORTS = ("auto", "grpc")
HTTP_SCHEMES = ("http://", "https://")  # a vLLM backend's address is its base URL

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

GENERATE_METHOD = "/unicache.v1.Replica/Generate"

PROBE_REQUEST_ID = "router-probe"
_PROBE = replica_pb2.GenerateRequest(
    request_id=PROBE_REQUEST_ID, token_ids=replica_pb2.TokenIds(ids=[0]), sampling=common_pb2.SamplingParams(max_tokens=1)
)


class GrpcReplicaStream(ReplicaStream):
    """A Generate over grpc.aio."""

    __slots__ = ("_call", "_done")

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        super().__init__()
        self._call = call
        self._done = False

    async def _read(self) -> router_pb2.RouterGenerateResponse | None:
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
        cluster_key: the key of the hop's handshake (None: none; set it with
            ``credential``).
        transport: "auto" (the framed hop where a replica advertises one, gRPC
            elsewhere; default) or "grpc" (always gRPC).
        hop_counter: a Prometheus counter labelled (outcome) that counts hop connections
            (``HopClient``); None counts nothing.
        tls: mutual TLS with the replicas (``unicache.plumbing.tls.ClientTls``): every connection,
            either transport, checks that its server's certificate names the replica id
            the call is for (the one in its signed heartbeat) before sending anything, and
            presents the router's client certificate; ``credential`` is then never sent.
            Rotated files are used for new connections (gRPC channels are remade).
    """

    def __init__(
        self,
        forward_deadline_s: float = 300.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        credential: CallCredential | None = None,
        cluster_key: bytes | None = None,
        transport: str = "auto",
        hop_counter=None,
        tls=None,  # noqa: ANN001 - unicache.plumbing.tls.ClientTls
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.forward_deadline_s = forward_deadline_s
        # NOTE: with TLS the client certificate authenticates the router; a bearer value
        # would only be something a squatter could capture and replay.
        self.credential = credential if tls is None else None
        self.tls = tls
        self._tls_generation = 0
        self._retired: list[grpc.aio.Channel] = []  # channels of rotated-out TLS files
        self.transport = transport
        self.max_message_bytes = max_message_bytes
        self._hop_auth = HopAuth(cluster_key) if cluster_key else None
        self._hop_counter = hop_counter
        self._hops: dict[str, HopClient] = {}  # replica id -> the hop client of its current hop address
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *keepalive_channel_options(),
        ]
        self._channels: dict[str, tuple[grpc.aio.Channel, replica_pb2_grpc.ReplicaStub, grpc.aio.UnaryStreamMultiCallable]] = {}
        self.vllm = VllmClients()  # stock vLLM servers, addressed by their HTTP base URL

    def _entry(self, address: str, replica_id: str = ""):
        """The channel entry for ``address``; with TLS one per (address, replica id), its
        server checked to be that replica ("": any replica of the cluster)."""
        if self.tls is None:
            key = address
        else:
            key = f"{replica_id}@{address}"
            generation = self.tls.generation
            if generation != self._tls_generation:
                self._tls_generation = generation
                # NOTE: calls under way finish on the old channels (closed with the client).
                self._retired.extend(entry[0] for entry in self._channels.values())
                self._channels.clear()
        entry = self._channels.get(key)
        if entry is None:
            entry = self._channels[key] = self._connect(address, self._options, self.tls, replica_id)
        return entry

    @staticmethod
    def _connect(address: str, options: list, tls=None, replica_id: str = ""):  # noqa: ANN001
        """(channel, stub, Generate multicallable reading ``parse_replica_message``)."""
        if tls is not None:
            channel = grpc.aio.secure_channel(address, tls.grpc_credentials(), options=[*options, *grpc_channel_options(replica_id)])
        else:
            channel = grpc.aio.insecure_channel(address, options=options)
        generate = channel.unary_stream(
            GENERATE_METHOD, request_serializer=replica_pb2.GenerateRequest.SerializeToString,
            response_deserializer=parse_replica_message,
        )
        return channel, replica_pb2_grpc.ReplicaStub(channel), generate

    def stub(self, address: str) -> replica_pb2_grpc.ReplicaStub:
        return self._entry(address)[1]

    def hop(self, hop_address: str, replica_id: str) -> HopClient:
        """The hop client of replica ``replica_id`` at ``hop_address`` (made once; a replica
        that moved to a new hop address retires its old one, so one replica holds at most
        one open hop plus the retiring ones' streams under way)."""
        client = self._hops.get(replica_id)
        if client is None or client.address != hop_address:
            self.forget_replica(replica_id)
            client = self._hops[replica_id] = HopClient(
                hop_address, replica_id, self._hop_auth, self.max_message_bytes, counter=self._hop_counter, tls=self.tls
            )
        return client

    def generate(
        self, address: str, request: replica_pb2.GenerateRequest, timeout_s: float | None = None, hop_address: str = "",
        replica_id: str = "",
    ) -> ReplicaStream:
        """Start a Generate with deadline ``timeout_s`` (default and bound ``forward_deadline_s``)
        on the replica at gRPC ``address``, over its framed hop at ``hop_address`` when it
        has one (see the module invariants); its messages are ``RouterGenerateResponse``."""
        deadline = self.forward_deadline_s if timeout_s is None else min(timeout_s, self.forward_deadline_s)
        if address.startswith(HTTP_SCHEMES):
            return self.vllm.generate(address, request, deadline)
        if hop_address and self.transport == "auto":
            return self.hop(hop_address, replica_id).stream(request, deadline)
        return GrpcReplicaStream(self._entry(address, replica_id)[2](request, timeout=deadline, metadata=self._metadata()))

    def forget_replica(self, replica_id: str) -> None:
        """Retire the hops to a replica that left the cluster: each closes once its open
        streams have ended (they end as they would on gRPC)."""
        client = self._hops.pop(replica_id, None)
        if client is not None:
            client.retire()

    async def probe(self, address: str, timeout_s: float, hop_address: str = "", replica_id: str = "") -> None:
        """A one-token Generate (one prompt token, no full block, so nothing is cached or
        published) that must send its first message within ``timeout_s``, on the transport
        requests take: can the replica serve now? A vLLM backend is asked its ``/health``.
        Raises grpc.aio.AioRpcError when it cannot."""
        if address.startswith(HTTP_SCHEMES):
            return await self.vllm.probe(address, timeout_s)
        stream = self.generate(address, _PROBE, timeout_s, hop_address, replica_id)
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
        for client in self._hops.values():
            client.close()
        self._hops.clear()
        await self.vllm.close()
        channels = [entry[0] for entry in self._channels.values()] + self._retired
        self._channels.clear()
        self._retired = []
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
