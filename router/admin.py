"""The optional admin key of the router's operator endpoints (/metrics, /v1/cluster/state,
/dashboard): they show replica ids, addresses and load, which clients need not see.

Off when the key is empty (local mode; the Helm chart sets it from ``auth.adminKey``). With
a key, a request must carry ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``),
compared in constant time; anything else gets the caller's 401 response, which never
echoes what was sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from unicache.router.auth import api_key_from_headers

Endpoint = Callable[[Request], Awaitable[Response]]


def require_admin(admin_key: str, endpoint: Endpoint, deny: Callable[[], Response]) -> Endpoint:
    """``endpoint`` itself when ``admin_key`` is empty, else a wrapper that answers
    ``deny()`` unless the request presents the admin key."""
    if not admin_key:
        return endpoint
    expected = admin_key.encode()

    async def guarded(request: Request) -> Response:
        given = api_key_from_headers(request.headers.get)
        if given is None or not hmac.compare_digest(given.encode(), expected):
            return deny()
        return await endpoint(request)

    return guarded
