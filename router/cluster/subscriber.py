"""Follow the replicas through Redis: heartbeats -> membership, events -> index.

Nothing read from Redis is trusted before its MAC verifies (unicache/contract/state_auth.py, cluster
key Redis never sees); what fails, is stale or replays is dropped and counted
(router/cluster/rejections.py). One asyncio task runs ``run()``, which repeats ``step()``:
    1. (every ``heartbeat_interval_s``) SCAN the heartbeat keys and open each sealed
       ``Heartbeat``: its replica id must be the key's, its wall-clock age at most
       ``max_state_age_s``, and its (epoch, seq) must not go back (replay) nor stay put
       longer than ``heartbeat_ttl_s`` (someone re-setting a dead replica's last beat).
       A new replica, or a known one at a new address, is *pending*: it joins (or moves)
       only once the peer at that address proved to be it (step 2). A key holding a
       rejected value leaves a known replica as its last valid beat left it, until that
       beat is ``heartbeat_ttl_s`` old. A known replica with no valid heartbeat (key
       gone, or only rejected values past the TTL) is asked to prove itself over its own
       channel (``fetch_summary`` with a fresh nonce, at every scan): it stays, as its
       last valid beat left it, while it does, and is dropped when it does not
       (policy.on_replica_died and index.drop_replica via ``ClusterView.remove``):
       deleting keys in Redis cannot take a live replica out of routing. A heartbeat naming an epoch newer than the index's marks
       the replica stale; an older one is a beat written before the replica's resync.
    2. Resync every pending replica and every replica the index marks stale (new, gap,
       epoch change, impossible claim) *from the replica itself*: ``fetch_summary``
       calls its ``GetCacheSummary`` with a fresh nonce; the answer must be sealed
       ("rpc-summary"), name that replica and echo the nonce. Then ``apply_summary``
       and replay the Redis event stream past the summary's seq (read backwards from the
       newest entry down to it). A failed resync is retried after ``resync_retry_s``.
       The Redis summary key and resync channel are the replicas' own business now: a
       router never takes holdings from Redis without the replica's signature.
    3. XREAD the event streams from each replica's cursor; each sealed batch must name
       the stream's replica. A batch of an older epoch, or at or below the applied seq,
       is a replay (dropped); one that does not follow (gap, newer epoch) or would exceed
       the replica's capacity schedules a resync.

Redis outages: any Redis error marks ``cluster.redis_connected = False`` (the service
then hands policies an empty index: session + load routing), keeps the last known
replicas, and retries with exponential backoff bounded by ``backoff_max_s``. When Redis
answers again every replica is marked for resync (the index is rebuilt from the replicas)
and, for ``reconnect_grace_s``, replicas whose heartbeat is missing are not dropped
(a restarted Redis holds no heartbeats until the replicas' next beat).

Every Redis call has a deadline (``timeout_s``; XREAD adds its block time), and so has
every ``fetch_summary``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from unicache.contract.block_hash import BlockHash
from unicache.contract.redis_keys import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, RedisKeys
from unicache.contract.state_auth import StateAuthError, StateSigner
from unicache.plumbing.aio import with_deadline
from unicache.router.cluster.rejections import StateRejections
from unicache.router.cluster.view import ClusterView
from unicache.v1 import cache_pb2

log = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
# (address, nonce, timeout_s) -> the replica's sealed GetCacheSummary answer; raises when
# the replica cannot be reached (ReplicaClients.cache_summary in the router).
FetchSummary = Callable[[str, bytes, float], Awaitable[bytes]]


@dataclass(slots=True)
class _Beat:
    """The newest verified heartbeat of a replica and when (router clock) it advanced."""

    mark: tuple[int, int]  # (epoch, seq)
    advanced_at: float


class RedisSubscriber:
    """Feeds a ``ClusterView`` from Redis.

    Args:
        cluster: membership + locality index to update.
        url: Redis URL (``rediss://`` for TLS).
        prefix: key prefix (``unicache.contract.redis_keys``).
        password: Redis password, if not in the URL.
        tls_ca: CA bundle path for TLS.
        timeout_s: deadline of each Redis call (default 1 s).
        block_ms: XREAD block time per step (default 200 ms).
        heartbeat_interval_s: how often heartbeats are scanned (default: the replicas'
            heartbeat interval, 1 s).
        reconnect_grace_s: after Redis returns, replicas without heartbeat are kept this
            long (default: the heartbeat TTL, 3 s).
        resync_retry_s: wait before retrying a resync that found no usable summary.
        backoff_initial_s / backoff_max_s: reconnect backoff bounds (0.1 s .. 5 s).
        replay_chunk: stream entries read per XREVRANGE while replaying after a summary
            (a resync reads only the batches newer than the summary, not the whole stream).
        expected_block_size: the router's block size; a replica announcing another one
            is logged (its hashes can never match the router's).
        clock: monotonic clock (tests may pass a fake one).
        signer: opens the replicas' sealed payloads (the cluster's state key; required).
        fetch_summary: asks a replica for its sealed summary (required; see
            ``FetchSummary``).
        rejections: counts what is dropped (default: a private counter, no metric).
        heartbeat_ttl_s: a heartbeat whose (epoch, seq) has not advanced this long is
            treated as gone (default: the replicas' TTL, 3 s).
        max_state_age_s: a heartbeat whose own timestamp is older than this (wall clock,
            so it tolerates this much clock skew) is stale (default 30 s).
        wall_clock: unix-time clock for ``max_state_age_s``.
        summary_timeout_s: deadline of one ``fetch_summary`` (default 5 s: a full cache's
            summary is tens of MB).
        probe_timeout_s: deadline of the proof asked of a known replica whose heartbeat
            key is missing (default 2 s); no proof in time drops it.
    """

    def __init__(
        self,
        cluster: ClusterView,
        url: str,
        prefix: str,
        password: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = 1.0,
        block_ms: int = 200,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        reconnect_grace_s: float = HEARTBEAT_TTL_S,
        resync_retry_s: float = 0.5,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        replay_chunk: int = 256,
        expected_block_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        signer: StateSigner,
        fetch_summary: FetchSummary,
        rejections: StateRejections | None = None,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        max_state_age_s: float = 30.0,
        wall_clock: Callable[[], float] = time.time,
        summary_timeout_s: float = 5.0,
        probe_timeout_s: float = 2.0,
    ):
        self.cluster = cluster
        self.keys = RedisKeys(prefix)
        self.timeout_s = timeout_s
        self.block_ms = block_ms
        self.heartbeat_interval_s = heartbeat_interval_s
        self.reconnect_grace_s = reconnect_grace_s
        self.resync_retry_s = resync_retry_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.replay_chunk = replay_chunk
        self.expected_block_size = expected_block_size
        self._warned_block_size: set[str] = set()
        self.clock = clock
        self.signer = signer
        self.fetch_summary = fetch_summary
        self.rejections = rejections or StateRejections()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_state_age_s = max_state_age_s
        self.wall_clock = wall_clock
        self.summary_timeout_s = summary_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._proved: dict[str, float] = {}  # replicas kept by a probe while their heartbeat is missing
        self.kept_alive = 0
        self._beats: dict[str, _Beat] = {}
        self._pending: dict[str, cache_pb2.Heartbeat] = {}
        kwargs = {"socket_timeout": timeout_s + block_ms / 1000.0, "socket_connect_timeout": timeout_s}
        if password:
            kwargs["password"] = password
        if tls_ca:
            kwargs["ssl_ca_certs"] = tls_ca
        self._url, self._client_kwargs = url, kwargs
        self.redis = aioredis.from_url(url, **kwargs)
        self._cursors: dict[str, bytes | str] = {}
        self._retry_at: dict[str, float] = {}
        self._next_scan = 0.0
        self._grace_until = 0.0
        self._ever_connected = False
        self._warned_at_start = False
        self.resyncs = 0
        self.reconnects = 0

    def new_client(self) -> aioredis.Redis:
        """Another client of the same Redis (same address, password and TLS), with a pool of
        its own: what the session store uses, so that its short deadlines, which cancel
        commands mid-reply, never break a connection this subscriber reads from."""
        return aioredis.from_url(self._url, **self._client_kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _call(self, coro, extra_s: float = 0.0):
        return await with_deadline(coro, self.timeout_s + extra_s)

    # --- the loop ---------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever; on Redis errors mark disconnected and back off (bounded)."""
        backoff = self.backoff_initial_s
        while True:
            try:
                waited = await self.step()
                backoff = self.backoff_initial_s
                if not waited:
                    await asyncio.sleep(self.block_ms / 1000.0)
            except REDIS_ERRORS as exc:
                if asyncio.current_task().cancelling():
                    # Stopping: the connection broke while the call was being cancelled.
                    raise asyncio.CancelledError from None
                if self.cluster.redis_connected or not (self._ever_connected or self._warned_at_start):
                    # NOTE: the exception's type only (its text may quote connection details).
                    self._warned_at_start = True
                    log.warning("redis unreachable (%s); routing on session and load until it returns", type(exc).__name__)
                self.cluster.redis_connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            except Exception:  # noqa: BLE001 - a bug or bad payload must not stop following Redis
                log.exception("redis subscriber step failed; retrying")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def step(self, block_ms: int | None = None) -> bool:
        """One round: reconnect check, heartbeats (when due), resyncs, one XREAD.

        Returns True when the XREAD blocked (so the caller need not sleep). Raises on Redis
        errors after marking the cluster disconnected.
        """
        try:
            if not self.cluster.redis_connected:
                await self._call(self.redis.ping())
                self._on_connected()
            now = self.clock()
            if now >= self._next_scan:
                await self.scan_heartbeats()
                self._next_scan = now + self.heartbeat_interval_s
            await self.resync_stale()
            return await self.poll_events(self.block_ms if block_ms is None else block_ms)
        except REDIS_ERRORS:
            self.cluster.redis_connected = False
            raise

    def _on_connected(self) -> None:
        self.cluster.redis_connected = True
        if self._ever_connected:
            self.reconnects += 1
            self._grace_until = self.clock() + self.reconnect_grace_s
            log.info("redis is back; rebuilding the locality index")
        self._ever_connected = True
        self._cursors.clear()
        self._retry_at.clear()
        self._next_scan = 0.0
        for rid in self.cluster.index.replicas():
            self.cluster.index.mark_resync(rid)

    # --- heartbeats -------------------------------------------------------------------
    async def scan_heartbeats(self) -> None:
        keys: list[bytes] = []
        cursor = 0
        while True:
            cursor, batch = await self._call(self.redis.scan(cursor, match=self.keys.heartbeat_pattern(), count=1000))
            keys.extend(batch)
            if cursor == 0:
                break
        values = await self._call(self.redis.mget(keys)) if keys else []
        seen: set[str] = set()
        now = self.clock()
        for key, raw in zip(keys, values):
            if raw is None:
                continue
            rid = self.keys.replica_from_heartbeat_key(key)
            hb = self._open(rid, "hb", raw, cache_pb2.Heartbeat, "heartbeat")
            if hb is None or not self._fresh(rid, hb):
                beat = self._beats.get(rid)
                if rid in self.cluster.replicas and beat is not None and now - beat.advanced_at <= self.heartbeat_ttl_s:
                    # NOTE: a forger overwrote a live replica's key between its beats: keep the
                    # replica as its last valid beat left it, until that is a TTL old.
                    seen.add(rid)
                continue
            seen.add(rid)
            bs = hb.cache.block_size
            if self.expected_block_size and bs and bs != self.expected_block_size and rid not in self._warned_block_size:
                self._warned_block_size.add(rid)
                log.warning("replica %s uses block size %d but the router %d: no prefix will match", rid, bs, self.expected_block_size)
            rec = self.cluster.replicas.get(rid)
            if rec is None or rec.address != hb.address:
                # NOTE: joins (or moves) only after the peer at hb.address proves to be rid.
                self._pending[rid] = hb
                continue
            self.cluster.upsert(rid, hb.address, hb)
            self.cluster.index.set_capacity(rid, hb.cache.capacity_blocks)
            self.cluster.index.set_host_capacity(rid, hb.cache.host.capacity_blocks)
            holdings = self.cluster.index.holdings(rid)
            # NOTE: only a *newer* epoch means the index is behind. A heartbeat written
            # before the replica's resync still names the old epoch until its next beat
            # (up to an interval later): read again in the meantime, it used to mark the
            # freshly synced replica stale at every scan (sessions then left the index's
            # view for ``session_sticky`` under live traffic after a Redis outage).
            if holdings.epoch >= 0 and hb.epoch > holdings.epoch:
                self.cluster.index.mark_resync(rid)
        for rid in [r for r in self._pending if r not in seen]:
            del self._pending[rid]
        if self.clock() < self._grace_until:
            return
        missing = [rid for rid, rec in self.cluster.replicas.items() if not rec.static and rid not in seen]
        if not missing:
            return
        # NOTE: Redis is how replicas are found, not the only proof of life: whoever can
        # write to Redis can delete keys. A replica whose heartbeat is gone stays (as its
        # last valid beat left it) while it proves itself over its own channel.
        alive = await asyncio.gather(*(self._proves_alive(rid) for rid in missing))
        for rid, ok in zip(missing, alive):
            if ok or rid not in self.cluster.replicas:
                continue
            log.info("replica %s heartbeat expired and it does not answer as itself; dropping it", rid)
            self.cluster.remove(rid)
            self._cursors.pop(rid, None)
            self._retry_at.pop(rid, None)
            self._beats.pop(rid, None)
            self._proved.pop(rid, None)

    async def _proof(self, replica_id: str, address: str, timeout_s: float, unreachable: str) -> cache_pb2.CacheSummary | None:
        """The replica's summary, sealed over a fresh nonce and fetched from ``address``:
        proof that what answers there is the replica itself. None when nothing answers
        (logged with ``unreachable``, whose ``{}`` is the error's type) or the answer fails
        its seal or nonce (counted as a rejection)."""
        nonce = os.urandom(16)
        try:
            raw = await self.fetch_summary(address, nonce, timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever the transport raised: no proof
            log.info("replica %s: %s", replica_id, unreachable.format(type(exc).__name__))
            return None
        summary = self._open(replica_id, "rpc-summary", raw, cache_pb2.CacheSummary, "summary from its address")
        if summary is not None and summary.nonce != nonce:
            self.rejections.reject("identity", replica_id, "summary from its address")
            return None
        return summary

    async def _proves_alive(self, replica_id: str) -> bool:
        """Whether the known replica, its heartbeat missing from Redis, still answers at
        its address as itself: a ``GetCacheSummary`` sealed over a fresh nonce and naming
        it (as at its admission), within ``probe_timeout_s``. Counted in ``kept_alive``."""
        rec = self.cluster.replicas.get(replica_id)
        if rec is None or not rec.address:
            return False
        # NOTE: unreachable or refusing: it is gone
        summary = await self._proof(replica_id, rec.address, self.probe_timeout_s, "heartbeat missing and no answer ({})")
        if summary is None:
            return False
        if replica_id not in self._proved:
            log.info("replica %s: heartbeat missing from Redis but it answers as itself; keeping it", replica_id)
        self._proved[replica_id] = self.clock()
        self.kept_alive += 1
        return True

    def _open(self, rid: str, kind: str, raw: bytes, cls, what: str):
        """Verify and parse one sealed payload stored for ``rid``; None (counted) if bad."""
        try:
            payload = self.signer.open(kind, raw)
        except StateAuthError as exc:
            self.rejections.reject(exc.reason, rid, what)
            return None
        msg = cls()
        try:
            msg.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - a signed but unparsable payload is a bug upstream
            self.rejections.reject("unparsable", rid, what)
            return None
        if msg.replica_id != rid:
            self.rejections.reject("wrong_replica", rid, what)
            return None
        return msg

    def _fresh(self, rid: str, hb: cache_pb2.Heartbeat) -> bool:
        """A verified heartbeat that is recent and moves forward (see the module docstring)."""
        if self.wall_clock() - hb.timestamp > self.max_state_age_s:
            self.rejections.reject("stale", rid, "heartbeat")
            return False
        now = self.clock()
        mark = (hb.epoch, hb.seq)
        beat = self._beats.get(rid)
        if beat is None or mark > beat.mark:
            self._beats[rid] = _Beat(mark, now)
            return True
        if mark < beat.mark:
            self.rejections.reject("replay", rid, "heartbeat")
            return False
        if now - beat.advanced_at > self.heartbeat_ttl_s:
            self.rejections.reject("stale", rid, "heartbeat")
            return False
        return True

    # --- resync -----------------------------------------------------------------------
    async def resync_stale(self) -> None:
        now = self.clock()
        for rid in sorted(set(self.cluster.replicas) | set(self._pending)):
            rec = self.cluster.replicas.get(rid)
            if rec is not None and rec.static:
                continue
            due = rid in self._pending or self.cluster.index.needs_resync(rid)
            if due and now >= self._retry_at.get(rid, 0.0):
                await self.resync(rid)

    async def resync(self, replica_id: str) -> bool:
        """Take the replica's own sealed summary (which also proves the peer at its
        address is it), then replay the Redis stream after it. Returns True when in sync."""
        self.resyncs += 1
        index = self.cluster.index
        pending = self._pending.get(replica_id)
        rec = self.cluster.replicas.get(replica_id)
        hb = pending if pending is not None else (rec.heartbeat if rec is not None else None)
        address = hb.address if hb is not None else (rec.address if rec is not None else "")
        self._retry_at[replica_id] = self.clock() + self.resync_retry_s
        if not address:
            return False
        # NOTE: unreachable or refusing: try again later
        summary = await self._proof(replica_id, address, self.summary_timeout_s, "cannot fetch its summary ({}); retrying")
        if summary is None:
            return False
        if pending is not None:
            del self._pending[replica_id]
            self.cluster.upsert(replica_id, pending.address, pending)
            self._cursors.pop(replica_id, None)
        if hb is not None:
            index.set_capacity(replica_id, hb.cache.capacity_blocks)
            index.set_host_capacity(replica_id, hb.cache.host.capacity_blocks)
        newest_id, newest_epoch, batches = await self._batches_after(replica_id, summary.epoch, summary.seq)
        self._cursors[replica_id] = newest_id
        try:
            parents = _parents(summary.parents, len(summary.block_hashes))
        except ValueError:
            self.rejections.reject("unparsable", replica_id, "summary from its address")
            return False
        if not index.apply_summary(replica_id, summary.epoch, summary.seq, [BlockHash(h) for h in summary.block_hashes],
                                   parents, host_hashes=[BlockHash(h) for h in summary.host_block_hashes]):
            self.rejections.reject("over_capacity", replica_id, "summary from its address")
            return False
        for batch in batches:
            if not self._apply(replica_id, batch):
                break
        if newest_epoch not in (None, summary.epoch) or index.needs_resync(replica_id):
            # The stream moved to another epoch than the summary's, or the batches right
            # after the summary were trimmed away: try again shortly.
            index.mark_resync(replica_id)
            return False
        self._retry_at.pop(replica_id, None)
        return True

    async def _batches_after(
        self, replica_id: str, epoch: int, seq: int
    ) -> tuple[bytes | str, int | None, list[cache_pb2.KVEventBatch]]:
        """Scan the stream backwards (``replay_chunk`` entries per call) down to the
        summary's (epoch, seq). Returns (newest entry id or "0-0", newest batch's epoch or
        None, the batches of ``epoch`` with seq > ``seq`` oldest first)."""
        key = self.keys.events(replica_id)
        newest_id: bytes | str = b"0-0"
        newest_epoch: int | None = None
        found: list[cache_pb2.KVEventBatch] = []
        seen_epoch = False
        upper: bytes | str = "+"
        while True:
            chunk = await self._call(self.redis.xrevrange(key, max=upper, min="-", count=self.replay_chunk))
            if not chunk:
                break
            if upper == "+":
                newest_id = chunk[0][0]
            for _entry_id, fields in chunk:
                batch = self._parse_batch(replica_id, fields)
                if batch is None:
                    continue
                if newest_epoch is None:
                    newest_epoch = batch.epoch
                if batch.epoch == epoch:
                    if batch.seq <= seq:
                        found.reverse()
                        return newest_id, newest_epoch, found
                    seen_epoch = True
                    found.append(batch)
                elif seen_epoch:  # an older epoch below this one's batches: done
                    found.reverse()
                    return newest_id, newest_epoch, found
            if len(chunk) < self.replay_chunk:
                break
            last_id = chunk[-1][0]
            upper = b"(" + last_id if isinstance(last_id, bytes) else "(" + last_id
        found.reverse()
        return newest_id, newest_epoch, found

    # --- events -----------------------------------------------------------------------
    async def poll_events(self, block_ms: int) -> bool:
        """XREAD every in-sync replica's stream once. Returns True when it blocked."""
        streams = {
            self.keys.events(rid): cursor
            for rid, cursor in sorted(self._cursors.items())
            if rid in self.cluster.replicas and not self.cluster.index.needs_resync(rid)
        }
        if not streams:
            return False
        kwargs = {"count": 1000}
        if block_ms > 0:
            kwargs["block"] = block_ms
        reply = await self._call(self.redis.xread(streams, **kwargs), extra_s=block_ms / 1000.0)
        prefix_len = len(self.keys.events(""))
        for stream_key, entries in reply or []:
            key = stream_key.decode() if isinstance(stream_key, bytes) else stream_key
            rid = key[prefix_len:]
            for entry_id, fields in entries:
                self._cursors[rid] = entry_id
                if self.cluster.index.needs_resync(rid):
                    continue
                batch = self._parse_batch(rid, fields)
                if batch is not None and not self._apply(rid, batch):
                    log.info("replica %s: event gap or new epoch at seq %d; resyncing", rid, batch.seq)
        return block_ms > 0

    def _apply(self, replica_id: str, batch: cache_pb2.KVEventBatch) -> bool:
        """Apply one verified batch. False when the index now needs a resync; a replayed
        batch (older epoch, or a seq already applied) is dropped and counted, never applied."""
        index = self.cluster.index
        h = index.holdings(replica_id)
        if not h.needs_resync and (batch.epoch < h.epoch or (batch.epoch == h.epoch and batch.seq <= h.applied_seq)):
            self.rejections.reject("replay", replica_id, "event batch")
            return True
        try:
            parents = _parents(batch.stored_parents, len(batch.stored))
        except ValueError:
            self.rejections.reject("unparsable", replica_id, "event batch")
            index.mark_resync(replica_id)
            return False
        ok = index.apply_events(
            replica_id,
            batch.epoch,
            batch.seq,
            [BlockHash(h) for h in batch.stored],
            [BlockHash(h) for h in batch.removed],
            batch.cleared,
            parents,
            host_stored=[BlockHash(h) for h in batch.host_stored],
            host_removed=[BlockHash(h) for h in batch.host_removed],
        )
        if not ok and h.fault in ("gap", "over_capacity"):
            self.rejections.reject(h.fault, replica_id, "event batch")
        return ok

    def _parse_batch(self, replica_id: str, fields: dict) -> cache_pb2.KVEventBatch | None:
        raw = fields.get(b"b", fields.get("b"))
        if raw is None:
            self.rejections.reject("unparsable", replica_id, "event batch")
            return None
        return self._open(replica_id, "events", raw, cache_pb2.KVEventBatch, "event batch")


def _parents(raw, n: int) -> list[BlockHash | None] | None:
    """A batch's or summary's parent hashes for the index: None when the sender sent
    none (older than the field: every block is indexed as a root). Raises ValueError
    when the list does not match its ``n`` blocks one to one (the payload is refused)."""
    if not raw:
        return None
    if len(raw) != n:
        raise ValueError(f"{len(raw)} parents for {n} blocks")
    return [BlockHash(p) if p else None for p in raw]
