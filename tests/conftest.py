"""Shared fixtures. Anything touching Redis gets its own redis-server on a free loopback port."""

from __future__ import annotations

import pytest

from unicache.redis_server import EmbeddedRedis


@pytest.fixture
def redis_server():
    """A fresh redis-server on 127.0.0.1:<free port>; killed after the test.

    Tests may call ``redis_server.stop()`` / ``redis_server.start()`` to simulate an
    outage (the port stays the same).
    """
    proc = EmbeddedRedis()
    proc.start()
    try:
        yield proc
    finally:
        proc.close()
