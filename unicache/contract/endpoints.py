"""Default addresses: where ``unicache up`` and ``unicache router`` serve, and where
``unicache status`` and ``unicache demo`` look when given no ``--router``.

One definition, so the commands that talk to a router find the one started locally
with no flags: gRPC on ``DEFAULT_GRPC_PORT`` of loopback.
"""

from __future__ import annotations

import os

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000
LOCAL_ROUTER = f"127.0.0.1:{DEFAULT_GRPC_PORT}"
ROUTER_ENV = "UNICACHE_ROUTER"


def default_router(env: dict[str, str] | None = None) -> str:
    """``$UNICACHE_ROUTER`` if set, else the local router (``LOCAL_ROUTER``)."""
    return (os.environ if env is None else env).get(ROUTER_ENV) or LOCAL_ROUTER
