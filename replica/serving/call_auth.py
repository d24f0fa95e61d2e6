"""The replica serves only holders of the cluster key: a gRPC server interceptor.

Every call to ``unicache.v1.Replica`` (Generate, GetCacheState, GetCacheSummary) must carry
a valid cluster credential (unicache/contract/state_auth.py ``CallCredential``, metadata key
``x-unicache-cluster-auth``); anything else is answered UNAUTHENTICATED before the request
is decoded or reaches the servicer, so prompts, salts and cache state stay between the
router and the replica. The standard health service stays open (liveness probes and the
launcher's readiness wait carry no credential; it reveals only SERVING / NOT_SERVING).

Invariant: the refusal message says what was wrong ("missing", "invalid", "expired") and
never echoes the credential.
"""

from __future__ import annotations

import logging
import time

import grpc

from unicache.contract.state_auth import CALL_METADATA, CallCredential, StateAuthError

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/unicache.v1.Replica/"


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts with UNAUTHENTICATED."""

    async def unary(request, context):  # noqa: ARG001
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):  # noqa: ARG001
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    # NOTE: no deserializer: a refused request is never parsed.
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class Refusals:
    """Callers refused for lacking the cluster key, on either transport (this interceptor,
    the framed hop's handshake): ``count`` of them, and at most one warning line per
    ``warn_interval_s`` (a caller retrying in a loop must not flood the log)."""

    def __init__(self, warn_interval_s: float = 60.0):
        self.count = 0
        self.warn_interval_s = warn_interval_s
        self._last_warn = float("-inf")

    def record(self, what: str, why: object) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last_warn >= self.warn_interval_s:
            self._last_warn = now
            log.warning("refused %s: %s (%d refused so far)", what, why, self.count)


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses replica calls without a valid cluster credential.

    Args:
        credential: checks the ``x-unicache-cluster-auth`` value.
        warn_interval_s: at most one warning line per this many seconds (default 60 s).
    """

    def __init__(self, credential: CallCredential, warn_interval_s: float = 60.0):
        self.credential = credential
        self.refusals = Refusals(warn_interval_s)

    @property
    def refused(self) -> int:
        return self.refusals.count

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        token = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == CALL_METADATA:
                token = value if isinstance(value, str) else value.decode("ascii", "replace")
                break
        try:
            self.credential.check(token)
        except StateAuthError as exc:
            self.refusals.record(handler_call_details.method, exc)
            return _refuse(handler, f"cluster credential required: {exc}")
        return handler
