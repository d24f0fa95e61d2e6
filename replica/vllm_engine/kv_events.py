"""vLLM's KV-cache events -> the project's events, keyed by our chained block hashes.

vLLM (``KVEventsConfig(publisher="zmq")``) publishes ``KVEventBatch`` messages on a PUB
socket as multipart ``(topic, seq: 8 bytes big-endian, msgpack payload)``, seq 0, 1, 2, ...
and answers replay requests on a ROUTER socket with every buffered batch from a given seq
on, then an end marker. ``KVEventSubscriber`` reads both (bound on ipc:// inside the
replica, so nothing listens on the network) and fills a gap from the replay socket.

``EventTranslator`` recomputes our hash of every stored block from the event's token ids,
the parent's (our) hash and the extra keys: the tenant salt (vLLM's ``cache_salt``, the
hex of our salt; first block only) and the adapter. vLLM's hash is used only as the key
of the translation table, so the router never depends on vLLM's hash scheme.

Invariants:
    * The table maps each vLLM hash present in vLLM's prefix cache to our hash, with the
      number of vLLM blocks holding it (vLLM does not de-duplicate); our ``BlockStored`` is
      emitted when the count goes 0 -> 1, ``BlockRemoved`` when it goes back to 0.
    * Its size is bounded by vLLM's pool size.
    * A batch that cannot be translated (a parent never seen: events were lost beyond what
      replay still holds) sets ``lost`` and the table restarts empty after an
      ``AllBlocksCleared``: the router forgets this replica's blocks rather than trusting a
      wrong index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VAllCleared
from vllm.distributed.kv_events import BlockRemoved as VRemoved
from vllm.distributed.kv_events import BlockStored as VStored
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from unicache.block_hash import ROOT_HASH, BlockHash, block_extra_keys, hash_block
from unicache.replica.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.replica.vllm_engine.request_meta import salt_from_vllm

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    ours: BlockHash
    count: int
    parent: BlockHash | None = None  # our hash of its parent (None: a first block)


class EventTranslator:
    """Folds vLLM event batches into our events (see the module invariants).

    Args:
        clock: timestamps of the events we emit (default ``time.time``).
    """

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._table: dict[object, _Entry] = {}
        self.lost = 0  # batches that could not be translated

    def __len__(self) -> int:
        return len(self._table)

    def cached_hashes(self) -> list[BlockHash]:
        return [e.ours for e in self._table.values()]

    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        return [(e.ours, e.parent) for e in self._table.values()]

    def our_hash(self, vllm_hash: object) -> BlockHash | None:
        entry = self._table.get(vllm_hash)
        return entry.ours if entry else None

    def translate(self, batch: KVEventBatch) -> list[KVEvent]:
        now = self.clock()
        out: list[KVEvent] = []
        for ev in batch.events:
            if isinstance(ev, VStored):
                if not self._stored(ev, now, out):
                    self.lost += 1
                    self._table.clear()
                    out.append(AllBlocksCleared(now))
            elif isinstance(ev, VRemoved):
                for vh in ev.block_hashes:
                    entry = self._table.get(vh)
                    if entry is None:
                        continue  # a block stored before a reset or a loss
                    entry.count -= 1
                    if entry.count == 0:
                        del self._table[vh]
                        out.append(BlockRemoved(entry.ours, now))
            elif isinstance(ev, VAllCleared):
                self._table.clear()
                out.append(AllBlocksCleared(now))
        return out

    def _stored(self, ev: VStored, now: float, out: list[KVEvent]) -> bool:
        bs = ev.block_size
        if ev.parent_block_hash is None:
            parent, first_index = ROOT_HASH, 0
        else:
            entry = self._table.get(ev.parent_block_hash)
            if entry is None:
                log.warning("vLLM event names an unknown parent block: cache index reset")
                return False
            parent, first_index = entry.ours, 1  # any index > 0: the salt is on block 0 only
        extra = ev.extra_keys or []
        for i, vh in enumerate(ev.block_hashes):
            index = first_index + i
            salt = _salt(extra[i] if i < len(extra) else None, ev.lora_name) if index == 0 else None
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            ours = hash_block(parent, tokens, block_extra_keys(index, salt, ev.lora_name))
            entry = self._table.get(vh)
            if entry is not None:
                entry.count += 1
            else:
                our_parent = None if parent == ROOT_HASH else parent
                self._table[vh] = _Entry(ours, 1, our_parent)
                out.append(BlockStored(ours, our_parent, now))
            parent = ours
        return True


def _salt(keys: tuple | None, lora_name: str | None) -> bytes | None:
    """The cache salt among a first block's event extra keys (bare strings: the LoRA name
    first, then the salt last)."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return salt_from_vllm(strings[-1]) if strings else None


class KVEventSubscriber:
    """Reads vLLM's event stream; ``take`` returns the batches that arrived, in seq order,
    gaps filled from the replay socket when it still holds them.

    Args:
        endpoint: vLLM's PUB endpoint (ipc://...).
        replay_endpoint: vLLM's replay ROUTER endpoint (ipc://...).
        replay_timeout_ms: deadline of one replay exchange (default 1000 ms).
    """

    def __init__(self, endpoint: str, replay_endpoint: str, replay_timeout_ms: int = 1000):
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop: take() is called every few ms
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.replayed = 0  # batches recovered through the replay socket
        self.missed = 0  # batches neither stream nor replay delivered

    def take(self) -> list[KVEventBatch]:
        out: list[KVEventBatch] = []
        while self._sub.poll(0):
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue  # already replayed
            if seq > self.next_seq:
                out.extend(self._replay(self.next_seq, seq))
            if seq > self.next_seq:  # replay could not fill the gap
                self.missed += seq - self.next_seq
            out.append(self._decoder.decode(payload))
            self.next_seq = seq + 1
        return out

    def _replay(self, start: int, stop: int) -> list[KVEventBatch]:
        """Batches ``start .. stop-1`` from vLLM's replay buffer (as many as it still has)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[KVEventBatch] = []
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(self._replay_timeout_ms):
                frames = sock.recv_multipart()
                _empty, _topic, seq_bytes, payload = frames
                if seq_bytes == ZmqEventPublisher.END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if start <= seq < stop and seq == self.next_seq:
                    got.append(self._decoder.decode(payload))
                    self.next_seq = seq + 1
            self.replayed += len(got)
        finally:
            sock.close(0)
        return got

    def close(self) -> None:
        self._sub.close(0)
