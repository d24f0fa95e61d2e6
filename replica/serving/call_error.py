"""How a replica call ends when it fails: one status for both transports (the gRPC
servicer and the framed hop, ``unicache.replica.serving.server`` and ``unicache.replica.serving.hop_server``),
and the gRPC ``Generate`` of any servicer written as a transport-neutral ``outputs``.

Invariant: ``EngineInputError("invalid")`` -> INVALID_ARGUMENT, ``("exhausted")`` ->
RESOURCE_EXHAUSTED with its refusal ("overloaded" or "too_large",
``unicache.contract.wire.REFUSAL_METADATA``), whichever transport carries it.
"""

from __future__ import annotations

import contextlib

import grpc

from unicache.contract.wire import REFUSAL_METADATA
from unicache.replica.engines.api import EngineInputError

STATUS_CODES: dict[str, grpc.StatusCode] = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class ReplicaCallError(Exception):
    """A ``Generate`` that must end with gRPC status ``code`` and ``details``;
    ``refusal``: why a RESOURCE_EXHAUSTED was refused ("overloaded" or "too_large",
    ``unicache.contract.wire.REFUSAL_METADATA``; "" otherwise)."""

    def __init__(self, code: grpc.StatusCode, details: str, refusal: str = ""):
        super().__init__(details)
        self.code = code
        self.details = details
        self.refusal = refusal

    @classmethod
    def from_input(cls, exc: EngineInputError) -> "ReplicaCallError":
        refusal = ("overloaded" if exc.overloaded else "too_large") if exc.kind == "exhausted" else ""
        return cls(STATUS_CODES[exc.kind], str(exc), refusal)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The refusal as gRPC trailing metadata (unicache/contract/wire.py)."""
        return ((REFUSAL_METADATA, self.refusal),) if self.refusal else ()


class GrpcGenerate:
    """Mixin: the gRPC ``Generate`` of a servicer whose ``outputs(request)`` (an async
    generator raising ``ReplicaCallError``) is the transport-neutral stream; the hop
    server serves the same ``outputs``. Closing the call (client cancelled) closes
    ``outputs`` at once."""

    async def Generate(self, request, context):
        async with contextlib.aclosing(self.outputs(request)) as outputs:
            try:
                async for msg in outputs:
                    yield msg
            except ReplicaCallError as exc:
                await context.abort(exc.code, exc.details, trailing_metadata=exc.trailing_metadata())
