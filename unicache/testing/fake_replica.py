"""A small in-process ``unicache.v1.Replica`` servicer for router tests.

Deterministic: it echoes the prompt's token ids (or a text prompt's UTF-8 bytes) back (one token per message, ``max_tokens``
of them, default 4) and keeps a real prefix cache of chained block hashes (the shared
``hash_token_blocks`` with the forwarded ``cache_salt``, hits capped by
``reusable_prompt_blocks`` as a real replica's scheduler caps them), so
``usage.cached_tokens`` is what a real replica would report. It records every request, can fail the next calls with a
status before the first token, and can hold a stream open to test cancellation.
It serves ``Generate`` over gRPC and, started with ``hop=True``, over the framed hop.
``GetCacheSummary`` answers sealed with the test cluster key (unicache/testing/signed_state.py):
``summary_blocks`` when a test sets it (what the replica claims to hold), else its cache.
"""

from __future__ import annotations

import asyncio

import grpc

from unicache.contract.block_hash import hash_token_blocks, reusable_prompt_blocks
from unicache.contract.state_auth import CALL_METADATA
from unicache.plumbing.grpc_server import keepalive_server_options
from unicache.plumbing.tls import TlsFiles, grpc_server_credentials, hop_server_context
from unicache.replica.serving.call_error import GrpcGenerate, ReplicaCallError
from unicache.replica.serving.hop_server import HopServer
from unicache.router.upstream.replica_client import PROBE_REQUEST_ID
from unicache.testing.signed_state import SIGNER, sealed
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc


class _MetadataRecorder(grpc.aio.ServerInterceptor):
    """Records the metadata keys of each call (what crossed the wire besides the request)
    and the last cluster credential received (``FakeReplica.last_credential``)."""

    def __init__(self, replica: "FakeReplica"):
        self.replica = replica

    async def intercept_service(self, continuation, handler_call_details):
        md = handler_call_details.invocation_metadata or ()
        self.replica.metadata_keys.append({k for k, _ in md})
        for k, v in md:
            if k == CALL_METADATA:
                self.replica.last_credential = v
        return await continuation(handler_call_details)


class FakeReplica(GrpcGenerate, replica_pb2_grpc.ReplicaServicer):
    def __init__(self, replica_id: str, block_size: int = 16, step_s: float = 0.0):
        """``step_s`` > 0: tokens come in engine steps of that length, every running
        stream's next token at the same step (as a batching engine makes them); 0: a
        stream's tokens all at once."""
        self.replica_id = replica_id
        self.step_s = step_s
        self._step: asyncio.Future | None = None
        self.block_size = block_size
        self.requests: list[replica_pb2.GenerateRequest] = []
        self.cached: set[bytes] = set()
        self.fail_next = 0
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.hold: asyncio.Event | None = None
        self.cancelled = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.hop: HopServer | None = None
        self.epoch = 1
        self.summary_blocks: list[bytes] | None = None
        self.signer = SIGNER
        self.metadata_keys: list[set[str]] = []
        self.last_credential: str | None = None

    @property
    def served(self) -> list[replica_pb2.GenerateRequest]:
        """The requests clients sent through the router (its quarantine probes left out)."""
        return [r for r in self.requests if r.request_id != PROBE_REQUEST_ID]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, hop: bool = False, cluster_key: bytes | None = None, tls: TlsFiles | None = None,
                    port: int = 0, hop_port: int = 0) -> None:
        """Serve gRPC on a free port (or ``port``), and with ``hop`` the framed hop too
        (with ``cluster_key``: the handshake); with ``tls`` both serve mutual TLS only.
        ``metadata_keys`` records the metadata keys of every call received."""
        self.server = grpc.aio.server(interceptors=[_MetadataRecorder(self)], options=keepalive_server_options())  # as a replica
        replica_pb2_grpc.add_ReplicaServicer_to_server(self, self.server)
        where = f"127.0.0.1:{port}"
        self.port = self.server.add_secure_port(where, grpc_server_credentials(tls)) if tls else self.server.add_insecure_port(where)
        await self.server.start()
        if hop:
            self.hop = HopServer(self, port=hop_port, cluster_key=cluster_key, grace_s=0.0, ssl=hop_server_context(tls) if tls else None)
            await self.hop.start()

    async def stop(self) -> None:
        if self.hop is not None:
            await self.hop.stop()
        if self.server is not None:
            await self.server.stop(0)

    async def _next_step(self) -> None:
        """Until the current engine step ends (one starts when a stream waits for none)."""
        step = self._step
        if step is None or step.done():
            loop = asyncio.get_running_loop()
            self._step = step = loop.create_future()
            loop.call_later(self.step_s, lambda: step.done() or step.set_result(None))
        await asyncio.shield(step)  # a cancelled stream must not end the step for the others

    async def outputs(self, request):
        """The stream ``Generate`` (gRPC, ``GrpcGenerate``) and the hop serve."""
        self.requests.append(request)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise ReplicaCallError(self.fail_code, "injected failure")
        # NOTE: a text prompt (a client calling the replica directly) is echoed as its
        # UTF-8 bytes, the router's default byte tokenizer's ids.
        ids = list(request.token_ids.ids) or list(request.text.encode())
        hashes = hash_token_blocks(ids, self.block_size, cache_salt=request.cache_salt or None)
        hit = 0
        for h in hashes[: reusable_prompt_blocks(len(ids), self.block_size)]:
            if h not in self.cached:
                break
            hit += 1
        self.cached.update(hashes)
        n = request.sampling.max_tokens or 4
        try:
            for i in range(n):
                if self.step_s > 0:
                    await self._next_step()
                tok = ids[i % len(ids)]
                msg = replica_pb2.GenerateResponse(index=0, token_ids=[tok], text=chr(tok))
                if i == n - 1:
                    msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    msg.usage.CopyFrom(
                        common_pb2.Usage(prompt_tokens=len(ids), cached_tokens=hit * self.block_size, completion_tokens=n)
                    )
                yield msg
                if self.hold is not None:
                    await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def GetCacheState(self, request, context):
        return common_pb2.CacheState(replica_id=self.replica_id, block_size=self.block_size, cached_blocks=len(self.cached))

    async def GetCacheSummary(self, request, context):
        blocks = self.summary_blocks if self.summary_blocks is not None else sorted(self.cached)
        summary = cache_pb2.CacheSummary(
            replica_id=self.replica_id, epoch=self.epoch, seq=0, block_hashes=blocks, block_size=self.block_size,
            nonce=request.nonce,
        )
        return replica_pb2.GetCacheSummaryResponse(signed_summary=sealed("rpc-summary", summary, self.signer))
