"""Session placement shared by every router of a cluster, through Redis.

Several router processes (``unicache router --workers N``) and pods serve one cluster; a
session's turns may reach any of them. Each router's routing policy remembers sessions
when it implements ``SharesRouterState`` (``cache_aware``: the latest turn's replica and
prompt hashes, ``SessionRecord``; the router builds no store for other policies); this
store makes that memory the cluster's: before choosing for a turn of session S the router
``load``s S's record and the policy imports it; after routing, the router ``save``s the
policy's record. So a turn is decided on the latest turn's placement whichever router
placed it, and a session's turns land where one router alone would have sent them.

Record: a ``SessionPlacement`` protobuf sealed with the cluster's state key (kind
"session", ``unicache.contract.state_auth``), at ``P:session:<digest>`` (``unicache.contract.redis_keys``),
``digest`` = HMAC-SHA256 of the session key under a key derived from the cluster key (first
16 bytes, hex): Redis never sees a session id, and the record names its digest, so a record
copied to another session's key is refused. TTL ``ttl_s``, refreshed by every turn.

Invariants:
    * Every Redis call has the deadline ``timeout_s``; a failure (Redis down, slow, a
      record that fails its MAC or names another digest) degrades to the policy's own
      memory for that turn (the router keeps serving) and is counted in ``errors`` /
      ``rejected``; nothing raises to the request path.
    * A record holds at most ``max_blocks`` hashes (longer prompts keep their first
      ``max_blocks``: the session-home rule reads the prefix shared with the previous turn),
      so a record is at most ``max_blocks * 16`` bytes plus ~100 bytes of envelope.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

from unicache.contract.block_hash import BlockHash
from unicache.contract.redis_keys import RedisKeys
from unicache.contract.state_auth import StateAuthError, StateSigner, derive
from unicache.router.routing.base import SessionRecord
from unicache.v1 import router_pb2

log = logging.getLogger(__name__)

HASH_BYTES = 16
KIND = "session"
DEFAULT_TTL_S = 3600.0


class SessionStore:
    """Reads and writes ``SessionPlacement`` records (see the module docstring).

    Args:
        redis: a ``redis.asyncio`` client (the router's, shared with its subscriber).
        prefix: the cluster's Redis key prefix.
        cluster_key: the cluster key (records are sealed with its state key).
        timeout_s: deadline of each Redis call (default 0.05 s: the store sits on the
            request path, and a miss only costs the policy's own memory for one turn).
        ttl_s: a session's record expires this long after its latest turn (1 h).
        max_blocks: hashes kept per record (default 4096 = 64 KiB).
        counter: a Prometheus counter labelled (op, outcome) to count calls in (the
            router's ``unicache_router_session_store``; None: the attributes only).
    """

    def __init__(self, redis, prefix: str, cluster_key: bytes, timeout_s: float = 0.05, ttl_s: float = DEFAULT_TTL_S,
                 max_blocks: int = 4096, counter=None):
        if timeout_s <= 0 or ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("timeout_s, ttl_s and max_blocks must be positive")
        self.redis = redis
        self.keys = RedisKeys(prefix)
        self.signer = StateSigner(cluster_key)
        self._digest_key = derive(cluster_key, "session-key/v1")
        self.timeout_s = timeout_s
        self.ttl_ms = int(ttl_s * 1000)
        self.max_blocks = max_blocks
        self.loads = self.hits = self.saves = self.errors = self.rejected = 0
        self._counter = counter
        self._children: dict[tuple[str, str], object] = {}

    def _count(self, op: str, outcome: str) -> None:
        if self._counter is not None:
            child = self._children.get((op, outcome))
            if child is None:
                child = self._children[(op, outcome)] = self._counter.labels(op, outcome)
            child.inc()

    def digest(self, key: str) -> bytes:
        """The 16-byte keyed digest naming session ``key`` in Redis."""
        return hmac.new(self._digest_key, key.encode("utf-8"), hashlib.sha256).digest()[:16]

    async def load(self, key: str) -> SessionRecord | None:
        """The cluster's record of session ``key``; None when there is none or it could not
        be read or trusted (counted)."""
        self.loads += 1
        digest = self.digest(key)
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self.redis.get(self.keys.session(digest.hex()))
        except Exception as exc:  # noqa: BLE001 - any failure degrades to local memory
            self.errors += 1
            self._count("load", "error")
            log.debug("session load failed: %s", type(exc).__name__)
            return None
        if raw is None:
            self._count("load", "miss")
            return None
        try:
            msg = router_pb2.SessionPlacement.FromString(self.signer.open(KIND, raw))
        except (StateAuthError, ValueError):
            self.rejected += 1
            self._count("load", "rejected")
            return None
        if msg.session != digest or not msg.replica_id or len(msg.hashes) % HASH_BYTES:
            self.rejected += 1
            self._count("load", "rejected")
            return None
        self.hits += 1
        self._count("load", "hit")
        h = msg.hashes
        hashes = [BlockHash(h[i : i + HASH_BYTES]) for i in range(0, len(h), HASH_BYTES)]
        return SessionRecord(msg.replica_id, hashes, msg.confirmed, msg.routed_at if msg.HasField("routed_at") else None)

    def encode(self, key: str, record: SessionRecord) -> tuple[str, bytes]:
        """(Redis key, sealed value) of ``record``."""
        digest = self.digest(key)
        msg = router_pb2.SessionPlacement(
            session=digest,
            replica_id=record.replica_id,
            hashes=b"".join(record.hashes[: self.max_blocks]),
            confirmed=record.confirmed,
            updated_ms=int(time.time() * 1000),
            routed_at=record.routed_at,
        )
        return self.keys.session(digest.hex()), self.signer.seal(KIND, msg.SerializeToString())

    async def save(self, key: str, record: SessionRecord) -> bool:
        """Write ``record`` as session ``key``'s latest turn (TTL refreshed); False when
        Redis failed (counted)."""
        rkey, value = self.encode(key, record)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.redis.set(rkey, value, px=self.ttl_ms)
        except Exception as exc:  # noqa: BLE001
            self.errors += 1
            self._count("save", "error")
            log.debug("session save failed: %s", type(exc).__name__)
            return False
        self.saves += 1
        self._count("save", "saved")
        return True
