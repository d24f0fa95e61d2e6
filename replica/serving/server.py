"""The replica's gRPC server: ``unicache.v1.Replica`` plus the standard health service.

``ReplicaServicer`` maps protobuf requests to ``EngineRequest`` and engine outputs back to
protobuf; it only uses the engine's public surface (``ServingEngine`` and the types of
replica/engines/api.py), whichever engine runs. ``ReplicaServer`` serves it with ``grpc.aio`` on one host/port.

Invariants:
    * Every ``Generate`` call closes its engine stream before returning, whether it ends
      normally, with an error, or because the client cancelled; closing the stream is
      what aborts the request and frees its blocks in the engine.
    * ``EngineInputError("invalid")`` -> INVALID_ARGUMENT, ``("exhausted")`` ->
      RESOURCE_EXHAUSTED; both before any message is streamed. Any other engine failure
      -> INTERNAL.
    * With a cluster key, every Replica call needs the cluster credential
      (replica/serving/call_auth.py) and ``GetCacheSummary`` answers sealed with the state key;
      without one (a replica nobody publishes for, tests) the port is open and
      ``GetCacheSummary`` is FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from unicache.contract.state_auth import CallCredential, StateSigner
from unicache.plumbing.grpc_decode import add_servicer
from unicache.plumbing.grpc_server import keepalive_server_options, pending_call_options
from unicache.plumbing.tls import TlsFiles, grpc_server_credentials, hop_server_context
from unicache.replica.engines.api import EngineInputError, EngineRequest
from unicache.replica.serving.call_auth import ClusterAuthInterceptor
from unicache.replica.serving.call_error import GrpcGenerate, ReplicaCallError
from unicache.replica.serving.convert import cache_state_to_proto, output_to_proto, request_class_from_proto, sampling_from_proto
from unicache.replica.serving.faults import FaultInjection
from unicache.replica.serving.hop_server import HopServer
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc

if TYPE_CHECKING:
    from unicache.replica.engines.api import ServingEngine
    from unicache.replica.publishing.metrics import ReplicaMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "unicache.v1.Replica"
class ReplicaServicer(GrpcGenerate, replica_pb2_grpc.ReplicaServicer):
    """Serves one engine.

    Args:
        engine: a started ``ServingEngine``.
        replica_id: reported in ``GetCacheState``.
        default_max_tokens: used when a request leaves ``max_tokens`` at 0 (default 16).
        faults: delays for reliability tests (replica/serving/faults.py); default none.
        summary_source: ``nonce -> sealed summary`` (the publisher's ``signed_summary``,
            set once it exists); None: ``GetCacheSummary`` is FAILED_PRECONDITION.
        metrics: the replica's Prometheus series (replica/publishing/metrics.py) every ``Generate``
            records into; None records nothing.
    """

    def __init__(
        self,
        engine: "ServingEngine",
        replica_id: str,
        default_max_tokens: int = 16,
        faults: FaultInjection | None = None,
        summary_source: Callable[[bytes], Awaitable[bytes]] | None = None,
        metrics: "ReplicaMetrics | None" = None,
    ):
        self.engine = engine
        self.replica_id = replica_id
        self.default_max_tokens = default_max_tokens
        self.faults = faults or FaultInjection()
        self.summary_source = summary_source
        self.metrics = metrics

    def to_engine_request(self, request: replica_pb2.GenerateRequest) -> EngineRequest:
        """Build the engine request; raises ``EngineInputError`` for a missing/empty prompt."""
        which = request.WhichOneof("prompt")
        if which is None:
            raise EngineInputError("invalid", "missing prompt: set either text or token_ids")
        if which == "text":
            token_ids = list(self.engine.encode(request.text, add_special_tokens=True))  # a completion prompt
        else:
            token_ids = list(request.token_ids.ids)
        if not token_ids:
            raise EngineInputError("invalid", "empty prompt: the prompt must contain at least one token")
        return EngineRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            sampling=sampling_from_proto(request.sampling, self.default_max_tokens),
            cls=request_class_from_proto(request.request_class),
            cache_salt=request.cache_salt or None,
            adapter_id=request.adapter_id or None,
        )

    async def outputs(self, request: replica_pb2.GenerateRequest) -> AsyncIterator[replica_pb2.GenerateResponse]:
        """The transport-neutral ``Generate``: the request's messages, in order; raises
        ``ReplicaCallError`` with the status the caller must end the call with. Closing
        this generator early (the caller was cancelled) closes the engine stream, which
        aborts the request and frees its blocks. Both the gRPC servicer and the framed
        hop (``unicache.replica.serving.hop_server``) serve it."""
        try:
            engine_request = self.to_engine_request(request)
        except EngineInputError as exc:
            raise ReplicaCallError.from_input(exc) from None
        timer = self.metrics.start_request() if self.metrics is not None else None
        faults = self.faults
        if faults.first_token_delay_s:
            await asyncio.sleep(faults.first_token_delay_s)
        stream = self.engine.generate(engine_request)
        try:
            try:
                sent = False
                async for out in stream:
                    if sent and faults.token_delay_s:
                        await asyncio.sleep(faults.token_delay_s)
                    if timer is not None:
                        timer.output(out)
                    yield output_to_proto(out)
                    sent = True
                if timer is not None:
                    timer.finish()
            except EngineInputError as exc:
                raise ReplicaCallError.from_input(exc) from None
            except Exception as exc:  # noqa: BLE001 - an engine failure must reach the client as a status
                log.exception("request %s failed in the engine", engine_request.request_id)
                raise ReplicaCallError(grpc.StatusCode.INTERNAL, f"engine failure: {exc}") from None
        finally:
            # NOTE: on client cancellation the caller's task is cancelled (grpc.aio, or the
            # hop server on CANCEL); the engine's generator sees CancelledError/GeneratorExit
            # and frees the request's blocks.
            await stream.aclose()

    async def GetCacheState(
        self, request: replica_pb2.GetCacheStateRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CacheState:
        return cache_state_to_proto(self.engine.cache_state(), self.replica_id)

    async def GetCacheSummary(
        self, request: replica_pb2.GetCacheSummaryRequest, context: grpc.aio.ServicerContext
    ) -> replica_pb2.GetCacheSummaryResponse:
        if self.summary_source is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this replica has no cluster key: it signs no summary")
        if len(request.nonce) != 16:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nonce must be 16 bytes")
        return replica_pb2.GetCacheSummaryResponse(signed_summary=await self.summary_source(request.nonce))


class ReplicaServer:
    """A ``grpc.aio`` server for one replica on ``host:port`` (port 0 picks a free port).

    Args:
        engine: a started ``ServingEngine``.
        replica_id: this replica's stable id.
        host: interface to bind (127.0.0.1 locally, 0.0.0.0 in a pod).
        port: port to bind; 0 lets the OS choose and ``port`` reads it back after start.
        default_max_tokens: see ``ReplicaServicer``.
        grace_s: how long ``stop`` lets in-flight calls finish (default 2 s).
        max_message_bytes: gRPC send/receive limit (default 64 MiB: long token-id prompts).
        faults: delays for reliability tests (replica/serving/faults.py); default none.
        cluster_key: when set, every Replica call needs the cluster credential
            (UNAUTHENTICATED otherwise) and ``GetCacheSummary`` can answer once
            ``servicer.summary_source`` is set.
        metrics: see ``ReplicaServicer``.
        max_pending_calls: calls grpc core lets wait for the servicer before cancelling
            any (``unicache.plumbing.grpc_server``): at least what the engine admits, running plus
            waiting (default 4096); also the framed hop's streams per connection.
        hop_port: the framed hop's port (``unicache.replica.serving.hop_server``: ``Generate``
            for routers, cheaper than gRPC); 0 picks a free one, None serves none.
        tls: this replica's TLS files (``unicache.plumbing.tls``): both transports then serve
            mutual TLS only (the router's client certificate from the cluster CA is
            required) and no call needs the bearer cluster credential; None: plain.
    """

    def __init__(
        self,
        engine: "ServingEngine",
        replica_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int = 16,
        grace_s: float = 2.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        faults: FaultInjection | None = None,
        cluster_key: bytes | None = None,
        metrics: "ReplicaMetrics | None" = None,
        max_pending_calls: int = 4096,
        hop_port: int | None = None,
        tls: "TlsFiles | None" = None,
    ):
        self.host = host
        self.tls = tls
        self.requested_port = port
        self.port = 0
        self.grace_s = grace_s
        self.servicer = ReplicaServicer(engine, replica_id, default_max_tokens, faults, metrics=metrics)
        self.health = health_aio.HealthServicer()
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *pending_call_options(max_pending_calls),
            *keepalive_server_options(),
        ]
        # NOTE: with TLS the router proves itself by its client certificate in every
        # handshake: no bearer value is asked for (or could be replayed).
        self.auth = ClusterAuthInterceptor(CallCredential(cluster_key)) if cluster_key and tls is None else None
        self.signer = StateSigner(cluster_key) if cluster_key else None
        self._server: grpc.aio.Server | None = None
        self.hop: HopServer | None = None
        if hop_port is not None:
            self.hop = HopServer(
                self.servicer, host, hop_port, cluster_key, max_streams=max_pending_calls,
                max_message_bytes=max_message_bytes, grace_s=grace_s, ssl=hop_server_context(tls) if tls is not None else None,
            )

    @property
    def hop_port(self) -> int:
        """The framed hop's bound port (0: none)."""
        return self.hop.port if self.hop is not None else 0

    async def start(self) -> int:
        """Bind, start serving, mark the service SERVING; returns the bound port."""
        if self.auth is None and self.tls is None:
            log.warning("replica %s has no cluster key: its gRPC port serves anyone", self.servicer.replica_id)
        server = grpc.aio.server(options=self._options, interceptors=[self.auth] if self.auth else None)
        add_servicer(replica_pb2_grpc.add_ReplicaServicer_to_server, self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        where = f"{self.host}:{self.requested_port}"
        port = server.add_secure_port(where, grpc_server_credentials(self.tls)) if self.tls is not None else server.add_insecure_port(where)
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {self.host}:{self.requested_port}")
        await server.start()
        self._server, self.port = server, port
        if self.hop is not None:
            try:
                await self.hop.start()
            except OSError:
                await server.stop(0)
                self._server = None
                raise
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("replica %s serving gRPC on %s:%d", self.servicer.replica_id, self.host, port)
        return port

    async def stop(self) -> None:
        """Report NOT_SERVING, then stop accepting calls (both transports) and wait ``grace_s``
        for running ones."""
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        stopping = [self._server.stop(self.grace_s)]
        if self.hop is not None:
            stopping.append(self.hop.stop())
        await asyncio.gather(*stopping)
        self._server = None
