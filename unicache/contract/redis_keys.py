"""The Redis key schema, in one place. Every key starts with a configurable prefix so one
Redis can serve several clusters.

Keys (``P`` is the prefix, default ``unicache``):
    P:hb:<replica_id>       string, a ``Heartbeat`` protobuf; TTL ``HEARTBEAT_TTL_S``,
                            refreshed every ``HEARTBEAT_INTERVAL_S`` (expires when the
                            replica dies).
    P:events:<replica_id>   stream; each entry has field ``b`` = a ``KVEventBatch``
                            protobuf; trimmed to about ``EVENT_STREAM_MAXLEN`` entries.
    P:summary:<replica_id>  string, a ``CacheSummary`` protobuf (all cached hashes as of
                            (epoch, seq)); rewritten periodically and on request.
    P:session:<digest>      string, a sealed ``SessionPlacement`` (router/cluster/session_store.py):
                            where one session's latest turn went, shared by every router;
                            ``<digest>`` is a keyed hash of (tenant, session id); TTL
                            ``session_ttl_s``, refreshed by every turn.
    P:routed                stream; each entry has field ``b`` = a sealed ``RoutedBatch``
                            (router/cluster/terms_exchange.py): one router's routing decisions
                            as the policy's terms see them, applied by every other router;
                            trimmed to about ``ROUTED_STREAM_MAXLEN`` entries.
    P:resync                pub/sub channel; a router publishes a replica id (or ``*``
                            for all) to ask that replica for a fresh summary now.

Epoch/seq (written by replica/publishing/publisher.py, read by router/cluster/index.py):
    * Within one epoch the stream's batches have seq 1, 2, 3, ... with no gap.
    * A summary at (epoch, seq) reflects every batch <= seq; a reader applies it, then
      the stream's batches of the same epoch with a larger seq.
    * Batches keep each hash's net effect (a reader applies cleared, removed, stored),
      so replaying a batch whose events a summary already reflects is harmless.
    * A new epoch (replica start/restart, or Redis came back after an error) atomically
      deletes the events stream and writes a summary at (new epoch, 0): the stream only
      ever holds batches of the summary's epoch. Epochs are wall-clock milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "unicache"
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 3.0
EVENT_FLUSH_INTERVAL_S = 0.05
SUMMARY_INTERVAL_S = 10.0
EVENT_STREAM_MAXLEN = 10_000
ROUTED_STREAM_MAXLEN = 10_000


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = DEFAULT_PREFIX

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.prefix}:hb:{replica_id}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:hb:*"

    def replica_from_heartbeat_key(self, key: str | bytes) -> str:
        k = key.decode() if isinstance(key, bytes) else key
        return k[len(self.prefix) + 4 :]

    def events(self, replica_id: str) -> str:
        return f"{self.prefix}:events:{replica_id}"

    def summary(self, replica_id: str) -> str:
        return f"{self.prefix}:summary:{replica_id}"

    def session(self, digest_hex: str) -> str:
        return f"{self.prefix}:session:{digest_hex}"

    def routed_stream(self) -> str:
        return f"{self.prefix}:routed"

    def resync_channel(self) -> str:
        return f"{self.prefix}:resync"
