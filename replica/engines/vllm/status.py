"""``PoolStatus``: vLLM's pool as our cache-state report needs it, sent from the engine-core
process (where the scheduler lives) to the replica over a local ipc:// ZMQ socket.

The publisher binds (PUB), the replica connects (SUB with CONFLATE: only the newest
snapshot matters). Each message is one whole snapshot, so a lost one is harmless.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import zmq

from unicache.replica.engines.api import CacheStateInfo


@dataclass(slots=True, frozen=True)
class PoolStatus:
    """One snapshot. Hit counters are prompt tokens since start (vLLM counts tokens)."""

    capacity_blocks: int
    free_blocks: int
    cached_blocks: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    queue_sizes: dict[str, int] = field(default_factory=dict)
    eviction_policy: str = ""
    queue_evictions: dict[str, int] = field(default_factory=dict)  # CacheStateInfo's meaning
    queue_hits: dict[str, int] = field(default_factory=dict)

    def cache_state(self, block_size: int) -> CacheStateInfo:
        """This snapshot as the replica's cache-state report (heartbeats, ``GetCacheState``,
        the ``unicache_replica_*`` series)."""
        return CacheStateInfo(
            block_size=block_size,
            capacity_blocks=self.capacity_blocks,
            used_blocks=self.capacity_blocks - self.free_blocks,
            free_blocks=self.free_blocks,
            cached_blocks=self.cached_blocks,
            hit_ratio=self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            queue_sizes=dict(self.queue_sizes),
            eviction_policy=self.eviction_policy,
            evictions=self.evictions,
            queue_evictions=dict(self.queue_evictions),
            queue_hits=dict(self.queue_hits),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "PoolStatus":
        return cls(**json.loads(raw))


class StatusPublisher:
    """PUB socket bound on ``endpoint`` (ipc://...) in the engine-core process."""

    def __init__(self, endpoint: str):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.bind(endpoint)

    def publish(self, status: PoolStatus) -> None:
        try:
            self._sock.send(status.to_bytes(), zmq.NOBLOCK)
        except zmq.Again:
            pass  # nobody reads fast enough: the next snapshot supersedes this one

    def close(self) -> None:
        self._sock.close(0)


class StatusSubscriber:
    """SUB socket in the replica; ``poll`` returns the newest snapshot seen (or the last one)."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.SUB)
        self._sock.setsockopt(zmq.CONFLATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.latest: PoolStatus | None = None

    def poll(self, timeout_ms: int = 0) -> PoolStatus | None:
        while self._sock.poll(timeout_ms):
            self.latest = PoolStatus.from_bytes(self._sock.recv())
            timeout_ms = 0
        return self.latest

    def close(self) -> None:
        self._sock.close(0)
