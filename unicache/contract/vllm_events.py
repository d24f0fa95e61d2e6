"""vLLM's KV-cache events, decoded without vLLM, and translated into our chained hashes.

One decoder for both consumers: the in-process vLLM replica (replica/engines/vllm) and the
router following stock ``vllm serve`` backends (router/upstream/vllm_fleet). Neither the router nor
this module imports vLLM (the router image has no torch); ``tests/contract/test_vllm_events.py``
checks these structs against batches a real vLLM 0.32 server published.

Wire (vLLM ``KVEventsConfig(publisher="zmq")``): a PUB socket sends multipart
``(topic, seq: 8 bytes big-endian, msgpack KVEventBatch)`` with seq 0, 1, 2, ...; a ROUTER
socket answers ``(b"", start seq)`` with every buffered batch from ``start`` on, each
``(b"", topic, seq, payload)``, then ``END_SEQ``. ``EventBatch`` is an array
``[ts, events, data_parallel_rank?]``; each event is a map tagged by its class name.

``EventTranslator`` recomputes our hash of every stored block from the event's token ids,
the parent's (our) hash and the extra keys: the tenant salt (vLLM's ``cache_salt``, the
hex of our salt; first block only) and the LoRA name. vLLM's hash is only the key of the
translation table, so nothing downstream depends on vLLM's hash scheme.

Invariants:
    * The table maps each (vLLM hash, tier) present in vLLM's cache to our hash, with the
      number of vLLM blocks holding it (vLLM does not de-duplicate); our ``BlockStored`` is
      emitted when the count goes 0 -> 1, ``BlockRemoved`` when it goes back to 0.
    * ``medium`` "GPU" (or none) is our GPU tier, "CPU" our host tier (vLLM's CPU offload);
      other media are not indexed.
    * Its size is bounded by vLLM's pool sizes (``max_entries`` caps it: a stream that
      claims more is an impossible claim and resets the table).
    * A batch that cannot be translated (a parent never seen: events were lost beyond what
      replay still holds) counts in ``lost`` and the table restarts empty after an
      ``AllBlocksCleared``: a consumer forgets this server's blocks rather than trusting a
      wrong index.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from unicache.contract.block_hash import ROOT_HASH, BlockHash, block_extra_keys, hash_block
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.contract.kv_tier import Tier
from unicache.v1 import common_pb2

log = logging.getLogger(__name__)

VLLM_SCHEMA_VERSION = "0.32"  # the vLLM release whose event schema these structs mirror
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker

MEDIUM_TIERS = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.HOST}


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(type=VllmEventBatch)


def decode_batch(payload: bytes) -> VllmEventBatch:
    """One msgpack ``KVEventBatch``; raises ``msgspec.DecodeError`` for anything else."""
    return _decoder.decode(payload)


# --- what a request carries into vLLM --------------------------------------------------
EXTRA_ARGS_KEY = "unicache_class"  # the request class, in SamplingParams.extra_args


def class_to_vllm(request_class: common_pb2.RequestClass) -> str:
    """The serialized request class as an ``extra_args`` / ``vllm_xargs`` value (base64:
    the HTTP API's JSON carries no bytes, and one encoding serves both paths)."""
    return base64.b64encode(request_class.SerializeToString()).decode("ascii")


def class_from_vllm(value: str | bytes) -> common_pb2.RequestClass:
    """``class_to_vllm``'s inverse; raises ValueError for anything else."""
    msg = common_pb2.RequestClass()
    try:
        msg.ParseFromString(base64.b64decode(value, validate=True))
    except Exception as exc:  # noqa: BLE001 - binascii.Error or a protobuf DecodeError
        raise ValueError(f"{EXTRA_ARGS_KEY} is not a serialized RequestClass") from exc
    return msg


def salt_to_vllm(salt: bytes | None) -> str | None:
    """Our tenant salt as vLLM's ``cache_salt`` (its hex)."""
    return salt.hex() if salt else None


def salt_from_vllm(cache_salt: str | None) -> bytes | None:
    return bytes.fromhex(cache_salt) if cache_salt else None


@dataclass(slots=True)
class _Entry:
    ours: BlockHash
    count: int
    parent: BlockHash | None = None  # our hash of its parent (None: a first block)


class EventTranslator:
    """Folds vLLM event batches into our events (see the module invariants).

    Args:
        clock: timestamps of the events we emit (default ``time.time``).
        max_entries: bound of the table (0: none); more distinct blocks than this is an
            impossible claim (the server's pools are smaller): the table is reset.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_entries: int = 0):
        self.clock = clock
        self.max_entries = max_entries
        self._table: dict[tuple[object, Tier], _Entry] = {}
        self.lost = 0  # batches that could not be translated (or claimed too much)

    def __len__(self) -> int:
        return len(self._table)

    def cached_hashes(self, tier: Tier = Tier.GPU) -> list[BlockHash]:
        return [e.ours for (_, t), e in self._table.items() if t == tier]

    def cached_blocks(self, tier: Tier = Tier.GPU) -> list[tuple[BlockHash, BlockHash | None]]:
        return [(e.ours, e.parent) for (_, t), e in self._table.items() if t == tier]

    def reset(self) -> None:
        """Forget everything (the stream was lost: a reconnect, a gap replay could not fill)."""
        self._table.clear()

    def translate(self, batch: VllmEventBatch) -> list[KVEvent]:
        now = self.clock()
        out: list[KVEvent] = []
        for ev in batch.events:
            if isinstance(ev, VllmBlockStored):
                tier = MEDIUM_TIERS.get(ev.medium)
                if tier is None:
                    continue
                if not self._stored(ev, tier, now, out) or (self.max_entries and len(self._table) > self.max_entries):
                    self.lost += 1
                    self._table.clear()
                    out.append(AllBlocksCleared(now))
            elif isinstance(ev, VllmBlockRemoved):
                tier = MEDIUM_TIERS.get(ev.medium)
                if tier is None:
                    continue
                for vh in ev.block_hashes:
                    entry = self._table.get((vh, tier))
                    if entry is None:
                        continue  # a block stored before a reset or a loss
                    entry.count -= 1
                    if entry.count == 0:
                        del self._table[(vh, tier)]
                        out.append(BlockRemoved(entry.ours, now, tier))
            else:
                self._table.clear()
                out.append(AllBlocksCleared(now))
        return out

    def _stored(self, ev: VllmBlockStored, tier: Tier, now: float, out: list[KVEvent]) -> bool:
        bs = ev.block_size
        if ev.parent_block_hash is None:
            parent, first_index = ROOT_HASH, 0
        else:
            # NOTE: a host-tier block's parent may sit on the GPU (offload copies a chain's
            # tail) and the other way round: look in both tiers.
            entry = self._table.get((ev.parent_block_hash, tier)) or self._table.get(
                (ev.parent_block_hash, Tier.HOST if tier == Tier.GPU else Tier.GPU)
            )
            if entry is None:
                log.warning("vLLM event names an unknown parent block: this server's index is reset")
                return False
            parent, first_index = entry.ours, 1  # any index > 0: the salt is on block 0 only
        extra = ev.extra_keys or []
        for i, vh in enumerate(ev.block_hashes):
            index = first_index + i
            salt = _salt(extra[i] if i < len(extra) else None, ev.lora_name) if index == 0 else None
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            ours = hash_block(parent, tokens, block_extra_keys(index, salt, ev.lora_name))
            entry = self._table.get((vh, tier))
            if entry is not None:
                entry.count += 1
            else:
                our_parent = None if parent == ROOT_HASH else parent
                self._table[(vh, tier)] = _Entry(ours, 1, our_parent)
                out.append(BlockStored(ours, our_parent, now, tier))
            parent = ours
        return True


def _salt(keys: list | None, lora_name: str | None) -> bytes | None:
    """The cache salt among a first block's event extra keys (bare strings: the LoRA name
    first, then the salt last)."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return salt_from_vllm(strings[-1]) if strings else None


class KVEventSubscriber:
    """Reads one vLLM server's event stream; ``take`` returns the batches that arrived, in
    seq order, gaps filled from the replay socket when it still holds them.

    ``take`` also reports whether the stream was broken since the last call (``broken``
    set): a reconnect (the server may have restarted, its seq from 0 and its cache empty)
    or a gap replay could not fill. A consumer then forgets what it derived from this
    stream (``EventTranslator.reset``) and starts over from the batches returned.

    Args:
        endpoint: vLLM's PUB endpoint (``tcp://host:port`` or ``ipc://path``).
        replay_endpoint: vLLM's replay ROUTER endpoint ("": none; gaps then break the stream).
        replay_timeout_ms: deadline of one replay exchange (default 1000 ms).
    """

    def __init__(self, endpoint: str, replay_endpoint: str = "", replay_timeout_ms: int = 1000):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop: take() is called every few ms
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self.next_seq: int | None = None  # None: take the next batch as the stream's start
        self.connected = False
        self.connects = 0  # connections made (a reconnect breaks the stream)
        self.broken = False  # the stream broke since the last take()
        self.replayed = 0  # batches recovered through the replay socket
        self.missed = 0  # batches neither stream nor replay delivered
        self.undecodable = 0  # payloads that are not a vLLM KVEventBatch
        self._catch_up = False  # request_catch_up() was called: the next take() replays from 0

    def take(self, timeout_ms: int = 0) -> list[VllmEventBatch]:
        """The batches that arrived (waiting up to ``timeout_ms`` for the first); clears
        and sets ``broken`` (see the class docstring)."""
        from zmq.utils.monitor import recv_monitor_message

        self.broken = False
        out: list[VllmEventBatch] = []
        if self._catch_up:
            self._catch_up = False
            self.next_seq = None
            out.extend(self._replay(0, 1 << 62, catch_up=True))
        events = dict(self._poller.poll(timeout_ms))
        while events:
            if self._monitor in events:
                while self._monitor.poll(0):
                    msg = recv_monitor_message(self._monitor)
                    if msg["event"] == self._zmq.EVENT_CONNECTED:
                        self.connected = True
                        self.connects += 1
                        if self.connects > 1:
                            self._break(out)
                        # NOTE: catch up at once from the server's replay buffer, so a router
                        # that connects late (or again) knows what the server cached before.
                        out.extend(self._replay(0, 1 << 62, catch_up=True))
                    elif msg["event"] == self._zmq.EVENT_DISCONNECTED:
                        self.connected = False
            while self._sub.poll(0):
                self._receive(self._sub.recv_multipart(), out)
            events = dict(self._poller.poll(0))
        return out

    def request_catch_up(self) -> None:
        """Make the next ``take`` start over from the server's replay buffer (a consumer
        that dropped what it built, after an impossible claim, resyncs this way)."""
        self._catch_up = True

    def _break(self, out: list) -> None:
        self.broken = True
        self.next_seq = None
        out.clear()

    def _receive(self, frames: list[bytes], out: list[VllmEventBatch]) -> None:
        if len(frames) != 3:
            self.undecodable += 1
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self.next_seq is None:
            # NOTE: the first batch seen: replay what the server still buffers before it, so a
            # router that joins late rebuilds this server's cache from its history.
            self.next_seq = 0
        if seq < self.next_seq:
            return  # already replayed
        if seq > self.next_seq:
            out.extend(self._replay(self.next_seq, seq))
        if seq > self.next_seq:  # replay could not fill the gap
            self.missed += seq - self.next_seq
            self._break(out)
        try:
            out.append(decode_batch(payload))
        except msgspec.DecodeError:
            self.undecodable += 1
        self.next_seq = seq + 1

    def _replay(self, start: int, stop: int, catch_up: bool = False) -> list[VllmEventBatch]:
        """Batches ``start .. stop-1`` from the server's replay buffer (as many as it has);
        ``catch_up``: the stream starts at the buffer's oldest batch (``next_seq`` unset)."""
        if not self._replay_endpoint:
            return []
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[VllmEventBatch] = []
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(self._replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    break
                _empty, _topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if catch_up and self.next_seq is None:
                    self.next_seq = seq  # the buffer's oldest: what came before is gone
                if start <= seq < stop and seq == self.next_seq:
                    try:
                        got.append(decode_batch(payload))
                    except msgspec.DecodeError:
                        self.undecodable += 1
                    self.next_seq = seq + 1
            self.replayed += len(got)
        finally:
            sock.close(0)
        return got

    def close(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(0)
        self._sub.close(0)
