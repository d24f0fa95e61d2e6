"""Publishes a replica's cache holdings and load to Redis (key schema: unicache/contract/redis_keys.py).

Three duties, each on its own asyncio task, none on the serving path:
    * events: every ``flush_interval_s`` take the engine's cache events, fold them into one
      ``KVEventBatch`` (replica/publishing/event_batch.py) and XADD it with the next seq;
    * summaries: a ``CacheSummary`` of every cached hash at start, every
      ``summary_interval_s``, when a router asks on the resync channel, and after Redis
      comes back;
    * heartbeat: a ``Heartbeat`` with a TTL, refreshed every ``heartbeat_interval_s``.

Every value written to Redis is sealed with the cluster's state key (unicache/contract/state_auth.py:
heartbeat kind "hb", summary "summary", batch "events"), so a router trusts only what a
holder of the cluster key wrote; Redis itself never sees the key. Heartbeats carry their
own counter ``seq`` (1, 2, ... within the process), so a replayed heartbeat never advances.

Epoch/seq contract (router/cluster/index.py): within one epoch, batch seqs are 1, 2, 3, ... with
no gap; a summary at (epoch, seq) reflects every batch <= seq (and possibly some later
events, which the net-effect batches replay harmlessly). When a batch may have been lost
(any Redis error), the publisher is *resync-needed*: it drops events it holds, and when
Redis answers again it starts a new epoch: deletes the stream, writes a summary at
(new epoch, 0), then continues with seq 1. A restarted replica starts a new epoch too
(epochs are wall-clock milliseconds, strictly increasing within a process).

Invariants:
    * Serving never waits on Redis: the engine's ``take_events`` / ``cached_hashes`` are
      the only calls into the engine, and every Redis call has a deadline (``op_timeout_s``).
    * ``seq`` increases by exactly one per published batch within an epoch; a batch is
      published only when every earlier batch of its epoch was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.asyncio.retry import Retry  # NOTE: the asyncio client awaits its retry: the sync Retry warns at every start

from unicache.contract.block_hash import BlockHash
from unicache.contract.state_auth import StateSigner
from unicache.plumbing.aio import cancel_and_wait, with_deadline
from unicache.contract.redis_keys import (
    EVENT_FLUSH_INTERVAL_S,
    EVENT_STREAM_MAXLEN,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    SUMMARY_INTERVAL_S,
    RedisKeys,
)
from unicache.contract.kv_events import KVEvent
from unicache.replica.engines.api import CacheStateInfo, EngineLoad
from unicache.replica.publishing.event_batch import PendingBatch
from unicache.replica.serving.convert import cache_state_to_proto
from unicache.v1 import cache_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


class CacheSource(Protocol):
    """What the publisher reads from an engine (every ``ServingEngine`` satisfies it)."""

    device: Any
    block_size: int

    def take_events(self) -> list[KVEvent]: ...
    def cached_hashes(self) -> list[BlockHash]: ...
    def host_hashes(self) -> list[BlockHash]: ...
    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]: ...
    def load(self) -> EngineLoad: ...
    def cache_state(self) -> CacheStateInfo: ...


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0
    summaries: int = 0
    heartbeats: int = 0
    resyncs: int = 0
    redis_errors: int = 0
    dropped_events: int = 0


class CachePublisher:
    """Publishes one replica's events, summaries and heartbeat.

    Args:
        source: the engine (see ``CacheSource``).
        replica_id: stable id (survives actor restarts).
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        address: ``host:port`` routers use to reach the replica's gRPC server.
        keys: key schema (prefix).
        flush_interval_s: event batching period (default 0.05 s).
        heartbeat_interval_s / heartbeat_ttl_s: heartbeat period and expiry (1 s / 3 s).
        summary_interval_s: periodic full summary (default 10 s).
        stream_maxlen: approximate cap on the event stream (default 10,000 batches).
        op_timeout_s: deadline of every Redis call (default 0.5 s).
        retry_interval_s: how often to retry Redis while resync-needed (default 0.25 s).
        clock: wall clock for timestamps and epochs (default ``time.time``).
        password: Redis password when it is not in the URL (a secret: never logged).
        tls_ca: CA bundle that verifies the server of a ``rediss://`` URL.
        signer: seals every payload with the cluster's state key (required).
        metrics_url: the replica's Prometheus endpoint, announced in every heartbeat.
        hop_address: its framed hop's ``host:port``, announced in every heartbeat ("": none).
    """

    def __init__(
        self,
        source: CacheSource,
        replica_id: str,
        redis_url: str,
        address: str,
        keys: RedisKeys | None = None,
        flush_interval_s: float = EVENT_FLUSH_INTERVAL_S,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        summary_interval_s: float = SUMMARY_INTERVAL_S,
        stream_maxlen: int = EVENT_STREAM_MAXLEN,
        op_timeout_s: float = 0.5,
        retry_interval_s: float = 0.25,
        clock: Callable[[], float] = time.time,
        password: str | None = None,
        tls_ca: str | None = None,
        *,
        signer: StateSigner,
        metrics_url: str = "",
        hop_address: str = "",
    ):
        if tls_ca and not redis_url.startswith("rediss://"):
            raise ValueError("redis_tls_ca needs a rediss:// redis_url")
        self.source = source
        self.replica_id = replica_id
        self.redis_url = redis_url
        self.address = address
        self.metrics_url = metrics_url
        self.hop_address = hop_address
        self.keys = keys or RedisKeys()
        self.flush_interval_s = flush_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.summary_interval_s = summary_interval_s
        self.stream_maxlen = stream_maxlen
        self.op_timeout_s = op_timeout_s
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self._auth = {k: v for k, v in (("password", password), ("ssl_ca_certs", tls_ca)) if v}
        self.signer = signer
        self.epoch = 0
        self.seq = 0
        self.heartbeat_seq = 0
        self.resync_needed = True  # nothing published yet: the first success is a resync
        self.stats = PublisherStats()
        self._pending = PendingBatch()
        self._lock = asyncio.Lock()
        self._summary_wanted = asyncio.Event()
        self._redis: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect and start the loops; tries one resync now but never fails on Redis."""
        self._redis = self._client()
        await self.try_resync()
        self._tasks = [
            asyncio.create_task(self._event_loop(), name=f"publisher-events-{self.replica_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"publisher-heartbeat-{self.replica_id}"),
            asyncio.create_task(self._summary_loop(), name=f"publisher-summary-{self.replica_id}"),
            asyncio.create_task(self._resync_listener(), name=f"publisher-resync-{self.replica_id}"),
        ]

    async def stop(self, remove_heartbeat: bool = True) -> None:
        """Flush what is pending, stop the loops, and (by default) delete the heartbeat so
        routers drop this replica at once instead of waiting for the TTL."""
        stuck = await cancel_and_wait(self._tasks)
        if stuck:
            log.warning("replica %s: %d publisher tasks did not stop", self.replica_id, len(stuck))
        self._tasks = []
        if self._redis is None:
            return
        await self.flush()
        if remove_heartbeat:
            await self._call(self._redis.delete(self.keys.heartbeat(self.replica_id)))
        with contextlib.suppress(Exception):
            await self._redis.aclose()
        self._redis = None

    def request_summary(self) -> None:
        """Ask for a fresh summary soon (what a message on the resync channel does)."""
        self._summary_wanted.set()

    # ------------------------------------------------------------------ one-shot operations
    async def flush(self) -> bool:
        """Take the engine's events and publish them as one batch. Returns False on error."""
        async with self._lock:
            return await self._flush_locked()

    async def publish_summary(self) -> bool:
        """Flush, then write a summary at (epoch, seq). Resyncs instead when needed."""
        if self.resync_needed:
            return await self.try_resync()
        async with self._lock:
            if not await self._flush_locked():
                return False
            return await self._write_summary(self.epoch, self.seq, delete_stream=False)

    async def try_resync(self) -> bool:
        """Start a new epoch: drop held events, delete the stream, write a summary at seq 0."""
        async with self._lock:
            dropped = len(self.source.take_events()) + self._pending.num_events
            self.stats.dropped_events += dropped
            self._pending = PendingBatch()
            epoch = max(self.epoch + 1, int(self.clock() * 1000))
            if not await self._write_summary(epoch, 0, delete_stream=True):
                return False
            log.info("replica %s published summary, epoch %d (was %d)", self.replica_id, epoch, self.epoch)
            self.epoch, self.seq = epoch, 0
            self.resync_needed = False
            self.stats.resyncs += 1
            return True

    async def publish_heartbeat(self) -> bool:
        """SET the heartbeat with its TTL; also checks the summary key still exists (a
        Redis that restarted empty without us seeing an error) and resyncs if not."""
        self.heartbeat_seq += 1
        hb = self.heartbeat()
        sealed = self.signer.seal("hb", hb.SerializeToString())
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.replica_id), sealed, px=self.heartbeat_ttl_ms)
        pipe.exists(self.keys.summary(self.replica_id))
        result = await self._call(pipe.execute())
        if result is None:
            return False
        self.stats.heartbeats += 1
        if not result[1] and not self.resync_needed:
            log.warning("replica %s: summary key vanished (Redis restarted?); resyncing", self.replica_id)
            self.resync_needed = True
        return True

    def heartbeat(self) -> cache_pb2.Heartbeat:
        load = self.source.load()
        return cache_pb2.Heartbeat(
            replica_id=self.replica_id,
            address=self.address,
            metrics_url=self.metrics_url,
            hop_address=self.hop_address,
            # NOTE: the router's /v1/models reports it (vLLM's model card does); a source
            # without one (a test double) reports 0, "unknown".
            max_model_len=getattr(self.source, "max_model_len", 0) or 0,
            device=str(self.source.device),
            running=load.running,
            waiting=load.waiting,
            queued_prefill_tokens=load.queued_prefill_tokens,
            cache=cache_state_to_proto(self.source.cache_state(), self.replica_id),
            epoch=self.epoch,
            timestamp=self.clock(),
            seq=self.heartbeat_seq,
        )

    async def signed_summary(self, nonce: bytes) -> bytes:
        """A sealed ("rpc-summary") ``CacheSummary`` at (epoch, seq) echoing ``nonce``:
        what the replica's ``GetCacheSummary`` returns. Flushes first, under the same lock
        as publishing, so the summary reflects every batch <= seq (the Redis contract)."""
        async with self._lock:
            if not self.resync_needed:
                await self._flush_locked()
            summary = self._summary(self.epoch, self.seq)
        summary.nonce = nonce
        return self.signer.seal("rpc-summary", summary.SerializeToString())

    # ------------------------------------------------------------------ internals
    async def _flush_locked(self) -> bool:
        self._pending.add(self.source.take_events())
        if self.resync_needed:
            self.stats.dropped_events += self._pending.num_events
            self._pending = PendingBatch()
            return False
        if self._pending.empty():
            return True
        batch = self._pending.to_proto(self.replica_id, self.epoch, self.seq + 1, self.clock())
        ok = await self._call(
            self._redis.xadd(
                self.keys.events(self.replica_id),
                {"b": self.signer.seal("events", batch.SerializeToString())},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
        )
        if ok is None:
            # The batch may or may not have landed; either way seq continuity is unknown.
            self.stats.dropped_events += self._pending.num_events
            self._pending = PendingBatch()
            return False
        self.seq += 1
        self.stats.batches += 1
        self._pending = PendingBatch()
        return True

    def _summary(self, epoch: int, seq: int) -> cache_pb2.CacheSummary:
        blocks = self.source.cached_blocks()
        return cache_pb2.CacheSummary(
            replica_id=self.replica_id,
            epoch=epoch,
            seq=seq,
            block_hashes=[h for h, _p in blocks],
            parents=[p or b"" for _h, p in blocks],
            host_block_hashes=self.source.host_hashes(),
            block_size=self.source.block_size,
            timestamp=self.clock(),
        )

    async def _write_summary(self, epoch: int, seq: int, delete_stream: bool) -> bool:
        summary = self._summary(epoch, seq)
        pipe = self._redis.pipeline(transaction=True)
        if delete_stream:
            pipe.delete(self.keys.events(self.replica_id))
        pipe.set(self.keys.summary(self.replica_id), self.signer.seal("summary", summary.SerializeToString()))
        if await self._call(pipe.execute()) is None:
            return False
        self.stats.summaries += 1
        return True

    async def _call(self, aw: Awaitable[T]) -> T | None:
        """Await one Redis call under the deadline; on any failure mark resync-needed."""
        try:
            return await with_deadline(aw, self.op_timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.stats.redis_errors += 1
            if not self.resync_needed:
                # NOTE: the exception's type only: messages may quote the server's reply or the
                # connection parameters, and a log line must never carry the password.
                log.warning("replica %s: Redis unavailable (%s); will resync", self.replica_id, type(exc).__name__)
            self.resync_needed = True
            return None

    def _client(self) -> aioredis.Redis:
        return aioredis.Redis.from_url(
            self.redis_url,
            socket_timeout=self.op_timeout_s,
            socket_connect_timeout=self.op_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            **self._auth,
        )

    async def _event_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            if self.resync_needed:
                await self._resync_after_outage()
            else:
                await self.flush()

    async def _resync_after_outage(self) -> None:
        # NOTE: drain the engine's queue even while Redis is down, so it cannot grow.
        async with self._lock:
            self.stats.dropped_events += len(self.source.take_events())
        if not await self.try_resync():
            await asyncio.sleep(self.retry_interval_s)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.publish_heartbeat()
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _summary_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._summary_wanted.wait(), self.summary_interval_s)
            self._summary_wanted.clear()
            await self.publish_summary()

    async def _resync_listener(self) -> None:
        """Subscribe to the resync channel; a message naming this replica (or ``*``) asks
        for a summary. Reconnects after errors, at most once per ``retry_interval_s``."""
        while True:
            pubsub = self._redis.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(self.keys.resync_channel()), self.op_timeout_s)
                while True:
                    msg = await asyncio.wait_for(
                        pubsub.get_message(ignore_subscribe_messages=True, timeout=self.op_timeout_s),
                        2 * self.op_timeout_s,
                    )
                    if msg and msg.get("type") == "message":
                        target = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
                        if target in (self.replica_id, "*", ""):
                            self.request_summary()
            except (RedisError, OSError, asyncio.TimeoutError):
                await asyncio.sleep(self.retry_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), self.op_timeout_s)
