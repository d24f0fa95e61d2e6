"""The HTTP front door's one error-to-response mapping (OpenAI's error shape).

Every failure a request can meet (bad key, bad body, unsupported parameter, unknown model
or path, a ``RouterError`` from routing or the replica, a timeout) becomes an ``ApiError``
through ``to_api_error``; ``error_response`` renders it as JSON and ``sse_error_event`` as
the error event of a stream that already started. Nothing else builds error bodies.

Body: ``{"error": {"message", "type", "param", "code"}}`` with ``type`` as OpenAI names it
for that status and ``code`` never null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from unicache.contract.chat_template import ChatFormatError
from unicache.router.request_path.auth import AuthError
from unicache.router.request_path.core import RouterError
from unicache.router.request_path.overload import retry_headers
from unicache.router.upstream.replica_stream import UpstreamAnswer

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    431: "request_header_fields_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}
# RouterError kinds; "too_large" is a replica saying the request can never fit its
# context (or its whole cache): OpenAI and vLLM answer that 400 context_length_exceeded.
_ROUTER_KINDS = {
    "invalid": (400, "invalid_value"),
    "unauthenticated": (401, "invalid_api_key"),
    "overloaded": (429, "rate_limit_exceeded"),
    "too_large": (400, "context_length_exceeded"),
    "unavailable": (503, "service_unavailable"),
    "upstream": (502, "upstream_error"),
    "deadline": (504, "timeout"),
}
CLIENT_CLOSED = 499  # nginx's "client closed request"; never reaches the client


@dataclass(eq=False)
class ApiError(Exception):
    """A request failure as the client sees it.

    ``outcome`` is the ``requests`` metric label (invalid, unauthenticated, a RouterError
    kind, ...). ``code`` defaults from the status (``DEFAULT_CODES``). ``raw``: a vLLM
    backend's own answer (``UpstreamAnswer``), sent instead of this shape.
    """

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    outcome: str = "invalid"
    headers: dict[str, str] | None = None  # sent with the answer (a 429's Retry-After)
    raw: UpstreamAnswer | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.code is None:
            self.code = DEFAULT_CODES.get(self.status, "error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def unsupported(param: str) -> ApiError:
    """A parameter this server does not implement: refused by name, never ignored."""
    return ApiError(400, f"unsupported parameter: {param!r} is not supported by this server", "unsupported_parameter", param)


def to_api_error(exc: BaseException) -> ApiError:
    """The one mapping from a failure to what the client gets (see the module docstring)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AuthError):
        return ApiError(401, str(exc), "invalid_api_key", outcome="unauthenticated")
    if isinstance(exc, ChatFormatError):
        return ApiError(400, str(exc), "invalid_value", "messages")
    if isinstance(exc, RouterError):
        if exc.answer is not None:  # vLLM's own answer, relayed as it is
            return ApiError(exc.answer.status, str(exc), outcome=exc.kind, raw=exc.answer)
        status, code = _ROUTER_KINDS[exc.kind]
        return ApiError(status, str(exc), code, outcome=exc.kind, headers=retry_headers(exc))
    if isinstance(exc, StopAsyncIteration):
        return ApiError(502, "replica returned an empty stream", outcome="upstream")
    raise TypeError(f"no HTTP mapping for {type(exc).__name__}") from exc


MAPPED = (ApiError, AuthError, ChatFormatError, RouterError, StopAsyncIteration)


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    if err.raw is not None:
        return Response(err.raw.body, status_code=err.status, media_type=err.raw.content_type, headers=headers)
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **(headers or {})} if err.headers else headers)


def sse_error_event(err: ApiError) -> bytes:
    """The error event of a stream whose 200 was already sent (then ``data: [DONE]``)."""
    return b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\n"


__all__ = [
    "ApiError",
    "CLIENT_CLOSED",
    "ClientDisconnect",
    "MAPPED",
    "bad_request",
    "error_response",
    "sse_error_event",
    "to_api_error",
    "unsupported",
]
