"""Register a generated gRPC servicer so that undecodable requests get INVALID_ARGUMENT.

grpc's Python server answers a request its protobuf deserializer rejects (corrupt wire
format, invalid UTF-8 in a ``string`` field) with UNKNOWN ("Unexpected DecodeError"),
which clients read as a server fault. ``add_servicer`` registers the same handlers the
generated ``add_XServicer_to_server`` would, with each request deserializer wrapped: a
``DecodeError`` becomes an ``Undecodable`` marker, and the method answers it with
INVALID_ARGUMENT without calling the servicer.

Invariant: the servicer's methods only ever see decoded protobuf messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

INVALID_MESSAGE = "request is not a valid {name} protobuf message: {error}"


class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class _Capture:
    """Collects what a generated ``add_XServicer_to_server`` registers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict[str, grpc.RpcMethodHandler]]] = []

    def add_generic_rpc_handlers(self, handlers) -> None:  # noqa: ARG002 - rebuilt below
        pass

    def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
        self.services.append((name, handlers))


def _lenient(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(INVALID_MESSAGE.format(name=method, error=exc))

    return deserialize


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The handler with a lenient deserializer and a behaviour that rejects markers."""
    parse = _lenient(handler.request_deserializer, method)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await inner(request, context)

        return handler._replace(request_deserializer=parse, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for msg in inner_stream(request, context):
                yield msg

        return handler._replace(request_deserializer=parse, unary_stream=unary_stream)
    return handler  # client-streaming methods: none in our services


def add_servicer(add_fn: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """``add_fn(servicer, server)`` (a generated ``add_XServicer_to_server``), with every
    unary request's decode failure answered as INVALID_ARGUMENT."""
    capture = _Capture()
    add_fn(servicer, capture)
    for name, handlers in capture.services:
        guarded = {m: _guard(h, f"{name}.{m}") for m, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, guarded),))
        server.add_registered_method_handlers(name, guarded)
