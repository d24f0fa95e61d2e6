"""The optional admin key of the router's operator endpoints: HTTP /metrics,
/v1/cluster/state and /dashboard, gRPC ``ListReplicas`` and ``GetClusterState``. They show
replica ids, addresses and load, which clients need not see.

Off when the key is empty (local mode; the Helm chart sets it from ``auth.adminKey``). With
a key, a request must carry ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``), as
an HTTP header or gRPC metadata, compared in constant time; anything else gets the
caller's refusal (HTTP 401 in OpenAI's shape, gRPC UNAUTHENTICATED), which never echoes
what was sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from unicache.router.request_path.auth import api_key_from_headers

Endpoint = Callable[[Request], Awaitable[Response]]


def presents_admin_key(admin_key: str, given: str | None) -> bool:
    """True when no admin key is set or ``given`` equals it (constant-time compare)."""
    if not admin_key:
        return True
    return given is not None and hmac.compare_digest(given.encode(), admin_key.encode())


def require_admin(admin_key: str, endpoint: Endpoint, deny: Callable[[], Response]) -> Endpoint:
    """``endpoint`` itself when ``admin_key`` is empty, else a wrapper that answers
    ``deny()`` unless the request presents the admin key."""
    if not admin_key:
        return endpoint

    async def guarded(request: Request) -> Response:
        if not presents_admin_key(admin_key, api_key_from_headers(request.headers.get)):
            return deny()
        return await endpoint(request)

    return guarded
