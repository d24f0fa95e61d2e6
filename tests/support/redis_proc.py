"""Start and stop a throw-away redis-server (tests and ``unicache up``'s embedded Redis use
``unicache.redis_server``; this wrapper only adds the test-friendly defaults)."""

from __future__ import annotations

from unicache.redis_server import EmbeddedRedis


class RedisProcess(EmbeddedRedis):
    """An ``EmbeddedRedis`` on loopback, no persistence, for one test."""
