"""vLLM's KV-cache events, decoded without vLLM, and translated into our chained hashes.

One decoder for both consumers: the in-process vLLM replica (replica/engines/vllm) and the
router following stock ``vllm serve`` backends (router/upstream/vllm_fleet). Neither the router nor
this module imports vLLM (the router image has no torch); ``tests/contract/test_vllm_events.py``
checks the translation against batches a real vLLM 0.32 server published; the structs and
their decoding in every form vLLM releases publish are ``vllm_event_schema``'s.

Wire (vLLM ``KVEventsConfig(publisher="zmq")``): a PUB socket sends multipart
``(topic, seq: 8 bytes big-endian, msgpack KVEventBatch)`` with seq 0, 1, 2, ...; a ROUTER
socket answers ``(b"", start seq)`` with every buffered batch from ``start`` on, each
``(b"", topic, seq, payload)``, then ``END_SEQ``. ``EventBatch`` is an array
``[ts, events, data_parallel_rank?]``; each event an array or a map tagged by its class
name, by release (``vllm_event_schema``).

``EventTranslator`` recomputes our hash of every stored block from the event's token ids,
the parent's (our) hash and the extra keys: the tenant salt (vLLM's ``cache_salt``, the
hex of our salt; first block only) and the LoRA name. vLLM's hash is only the key of the
translation table, so nothing downstream depends on vLLM's hash scheme.

Invariants:
    * The table maps each (vLLM hash, tier) present in vLLM's cache to our hash, with the
      number of vLLM blocks of each KV cache group holding it (vLLM does not de-duplicate);
      our ``BlockStored`` is emitted when every full-attention group of its tier holds it
      (one group: its count goes 0 -> 1), ``BlockRemoved`` when one of them no longer
      does. Sliding-window and Mamba groups' blocks go to ``EventTranslator.windows``.
    * ``medium`` "GPU" (or none) is our GPU tier, "CPU" our host tier (vLLM's CPU offload);
      other media ("STORAGE", ...) are not indexed.
    * ``schema`` is the form (``vllm_event_schema.SCHEMAS``) of the last batch with events.
    * Its size is bounded by vLLM's pool sizes (``max_entries`` caps it: a stream that
      claims more at the end of a batch is an impossible claim and resets the table; within
      a batch a publisher may store before it removes).
    * A batch that cannot be translated (a parent never seen: events were lost beyond what
      replay still holds) counts in ``lost`` and the table restarts empty after an
      ``AllBlocksCleared``: a consumer forgets this server's blocks rather than trusting a
      wrong index.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from unicache.contract.block_hash import ROOT_HASH, BlockHash, block_extra_keys, hash_block
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.contract.kv_tier import Tier
from unicache.contract.vllm_event_schema import (  # noqa: F401 - the decoder's names, re-exported
    MEDIUM_CPU,
    MEDIUM_GPU,
    SCHEMAS,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmEventBatch,
    decode_batch,
    schema_of,
)
from unicache.v1 import common_pb2

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker

MEDIUM_TIERS = {None: Tier.GPU, MEDIUM_GPU: Tier.GPU, MEDIUM_CPU: Tier.HOST}  # other media: not indexed


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


FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(slots=True)
class _Entry:
    ours: BlockHash
    count: int  # vLLM blocks holding it, every group together
    parent: BlockHash | None = None  # our hash of its parent (None: a first block)
    groups: dict = field(default_factory=dict)  # KV cache group -> vLLM blocks of it holding it
    visible: bool = False  # our BlockStored emitted: every full-attention group holds it


@dataclass(slots=True)
class Window:
    """A sliding-window (or Mamba) group of a hybrid model: a prefix of n blocks is a hit
    there when it holds blocks ``n - blocks .. n - 1`` (all of them if n < ``blocks``),
    as vLLM's ``SlidingWindowManager.find_longest_cache_hit`` asks; ``held`` is the set of
    our hashes of its blocks (updated in place)."""

    blocks: int
    held: set[BlockHash] = field(default_factory=set)


def group_role(kind: str | None, window_tokens: int | None, block_size: int) -> tuple[str, int]:
    """A KV cache group's part in a prefix hit, from its ``BlockStored`` fields: ("full", 0)
    (every block of the prefix; also a group without a kind: one-group models and
    releases before the kinds), ("window", k) (its last k blocks; Mamba: the last state)
    or ("ignored", 0) (kinds prefix caching does not consult, or we cannot size)."""
    if kind is None or kind in FULL_KINDS or (kind in WINDOW_KINDS and not window_tokens):
        return "full", 0
    if kind in WINDOW_KINDS:
        k = -(-(window_tokens - 1) // block_size)  # cdiv(sliding_window - 1, block_size), as vLLM
        return ("window", k) if k > 0 else ("ignored", 0)
    if kind == "mamba":
        return "window", 1
    return "ignored", 0


class EventTranslator:
    """Folds vLLM event batches into our events (see the module invariants).

    KV cache groups (hybrid models). vLLM stores each block once per group (``group_idx``,
    its kind on every ``BlockStored``). A block is ours to index (our ``BlockStored``,
    ``cached_hashes``) while every full-attention group of its tier holds it; the blocks
    of sliding-window and Mamba groups go to ``windows`` (GPU tier), which a consumer
    hands to the index so that a prefix counts only as far as each window holds the
    blocks it needs. A one-group stream (every model but hybrids, every release before
    ``group_idx``) is the plain case: a block is indexed while the server holds it.

    Args:
        clock: timestamps of the events we emit (default ``time.time``).
        max_entries: bound of the table (0: none); more distinct blocks than this is an
            impossible claim (the server's pools are smaller): the table is reset.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_entries: int = 0):
        self.clock = clock
        self.max_entries = max_entries
        self._table: dict[tuple[object, Tier], _Entry] = {}
        self._full: dict[Tier, set] = {}  # tier -> its full-attention groups seen so far
        self._roles: dict[object, tuple[str, int]] = {}  # group -> group_role(...)
        self.windows: dict[object, Window] = {}  # group -> its window (GPU tier)
        self.lost = 0  # batches that could not be translated (or claimed too much)
        self.schema: str | None = None  # the form the stream's events come in (vllm_event_schema.SCHEMAS)

    def __len__(self) -> int:
        return len(self._table)

    def cached_hashes(self, tier: Tier = Tier.GPU) -> list[BlockHash]:
        return [e.ours for (_, t), e in self._table.items() if t == tier and e.visible]

    def cached_blocks(self, tier: Tier = Tier.GPU) -> list[tuple[BlockHash, BlockHash | None]]:
        return [(e.ours, e.parent) for (_, t), e in self._table.items() if t == tier and e.visible]

    def window_constraints(self) -> list[tuple[int, set[BlockHash]]]:
        """``(blocks, held)`` of each window group (``LocalityIndex.set_windows``'s input)."""
        return [(w.blocks, w.held) for w in self.windows.values()]

    def reset(self) -> None:
        """Forget everything (the stream was lost: a reconnect, a gap replay could not fill)."""
        self._clear()
        self._full.clear()
        self._roles.clear()
        self.windows.clear()

    def _clear(self) -> None:
        self._table.clear()
        for w in self.windows.values():
            w.held.clear()

    def translate(self, batch: VllmEventBatch) -> list[KVEvent]:
        now = self.clock()
        out: list[KVEvent] = []
        self.schema = schema_of(batch) or self.schema
        deferred: list = []  # window groups' events: after the full groups' (theirs name our hashes)
        for ev in batch.events:
            if isinstance(ev, VllmAllBlocksCleared):
                self._run(deferred, now, out)
                self._clear()
                out.append(AllBlocksCleared(now))
            elif self._role(ev)[0] == "window":
                deferred.append(ev)
            else:
                self._apply(ev, now, out)
        self._run(deferred, now, out)
        if self.max_entries and len(self._table) > self.max_entries:
            self._lose(now, out)
        return out

    def _lose(self, now: float, out: list[KVEvent]) -> None:
        """What was translated cannot be trusted: the table restarts empty and the
        consumer is told every block is gone."""
        self.lost += 1
        self._clear()
        out.append(AllBlocksCleared(now))

    def _role(self, ev) -> tuple[str, int]:
        g = ev.group_idx
        if isinstance(ev, VllmBlockStored) and g not in self._roles:
            role = self._roles[g] = group_role(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.block_size)
            if role[0] == "window":
                self.windows[g] = Window(role[1])
            elif role[0] == "ignored":
                log.info("vLLM KV cache group %s (%s) does not bound prefix hits here", g, ev.kv_cache_spec_kind)
        return self._roles.get(g, ("full", 0))

    def _run(self, events: list, now: float, out: list[KVEvent]) -> None:
        for ev in events:
            self._apply(ev, now, out)
        events.clear()

    def _apply(self, ev, now: float, out: list[KVEvent]) -> None:
        tier = MEDIUM_TIERS.get(ev.medium)
        if tier is None:
            return
        role = self._role(ev)[0]
        if role == "window" and tier != Tier.GPU:
            return  # a host tier's copies are read through the GPU chain only
        if isinstance(ev, VllmBlockStored):
            if role == "full":
                full = self._full.setdefault(tier, set())
                if ev.group_idx not in full:
                    full.add(ev.group_idx)
                    if len(full) > 1:
                        self._hide_all(tier, now, out)  # a new full group holds none of them yet
            if not self._stored(ev, tier, role, now, out):
                self._lose(now, out)
            return
        g = ev.group_idx
        for vh in ev.block_hashes:
            entry = self._table.get((vh, tier))
            if entry is None or g not in entry.groups:
                continue  # a block stored before a reset or a loss
            entry.count -= 1
            entry.groups[g] -= 1
            if entry.groups[g] == 0:
                del entry.groups[g]
                if role == "window":
                    self.windows[g].held.discard(entry.ours)
                elif entry.visible and role == "full":
                    entry.visible = False
                    out.append(BlockRemoved(entry.ours, now, tier))
            if entry.count == 0:
                del self._table[(vh, tier)]

    def _hide_all(self, tier: Tier, now: float, out: list[KVEvent]) -> None:
        for (_, t), e in self._table.items():
            if t == tier and e.visible:
                e.visible = False
                out.append(BlockRemoved(e.ours, now, tier))

    def _stored(self, ev: VllmBlockStored, tier: Tier, role: str, now: float, out: list[KVEvent]) -> bool:
        bs = ev.block_size
        g = ev.group_idx
        # NOTE: a window group skips the blocks outside its window (vLLM's null blocks) but
        # its token ids still cover them: its hashes then map to blocks by the table only.
        aligned = len(ev.token_ids) == len(ev.block_hashes) * bs
        if ev.parent_block_hash is None:
            parent, first_index = ROOT_HASH, 0
        else:
            # NOTE: a host-tier block's parent may sit on the GPU (offload copies a chain's
            # tail) and the other way round: look in both tiers.
            entry = self._table.get((ev.parent_block_hash, tier)) or self._table.get(
                (ev.parent_block_hash, Tier.HOST if tier == Tier.GPU else Tier.GPU)
            )
            if entry is None:
                if role == "window":
                    aligned = False
                else:
                    log.warning("vLLM event names an unknown parent block: this server's index is reset")
                    return False
            else:
                parent, first_index = entry.ours, 1  # any index > 0: the salt is on block 0 only
        extra = ev.extra_keys or []
        adapter = _adapter(ev)
        full = self._full.get(tier, ())
        for i, vh in enumerate(ev.block_hashes):
            entry = self._table.get((vh, tier))
            if entry is None:
                if not aligned:
                    continue  # which tokens it holds is unknown: not indexed
                index = first_index + i
                salt = _salt(extra[i] if i < len(extra) else None, ev.lora_name) if index == 0 else None
                tokens = ev.token_ids[i * bs : (i + 1) * bs]
                ours = hash_block(parent, tokens, block_extra_keys(index, salt, adapter))
                entry = self._table[(vh, tier)] = _Entry(ours, 0, None if parent == ROOT_HASH else parent)
            entry.count += 1
            entry.groups[g] = entry.groups.get(g, 0) + 1
            if role == "window":
                self.windows[g].held.add(entry.ours)
            elif role == "full" and not entry.visible and all(f in entry.groups for f in full):
                entry.visible = True
                out.append(BlockStored(entry.ours, entry.parent, now, tier))
            parent = entry.ours
        return True


def _adapter(ev: VllmBlockStored) -> str | None:
    """The adapter extra key of a stored block: vLLM's ``lora_name``. A release that publishes
    only the deprecated ``lora_id`` gets ``lora-id:<id>``: no request names that, so its blocks
    never pass for the base model's (a router hit it would not get)."""
    if ev.lora_name:
        return ev.lora_name
    return f"lora-id:{ev.lora_id}" if ev.lora_id else None


def _salt(keys: list | None, lora_name: str | None) -> bytes | None:
    """The cache salt among a first block's event extra keys (bare strings: the LoRA name
    first, then the salt last)."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return salt_from_vllm(strings[-1]) if strings else None


class KVEventSubscriber:
    """Reads one vLLM server's event stream: the batches that arrived, in seq order, gaps
    filled from the replay socket when it still holds them. ``take`` reads what is there
    (a synchronous caller: the in-process replica); ``take_async`` waits on the event loop
    for the stream to have something (no thread, no polling timeout: an idle stream costs
    nothing), replays included.

    Each take also reports whether the stream was broken since the last one (``broken``
    set): a reconnect (the server may have restarted, its seq from 0 and its cache empty)
    or a gap replay could not fill. A consumer then forgets what it derived from this
    stream (``EventTranslator.reset``) and starts over from the batches returned.

    Args:
        endpoint: vLLM's PUB endpoint (``tcp://host:port`` or ``ipc://path``).
        replay_endpoint: vLLM's replay ROUTER endpoint ("": none; gaps then break the stream).
        replay_timeout_ms: deadline of one replay exchange (default 1000 ms).
    """

    MAX_FRAMES_PER_TAKE = 1024  # take_async returns after this many (the loop serves others)

    def __init__(self, endpoint: str, replay_endpoint: str = "", replay_timeout_ms: int = 1000):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop: the consumer reads as batches come
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        # take_async's wake-up: set by the event loop's readers of the two sockets' FDs
        # (registered once, at the first take_async), cleared before each wait
        self._wake: asyncio.Event | None = None
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self.endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self.next_seq: int | None = None  # None: take the next batch as the stream's start
        self.connected = False
        self.connects = 0  # connections made (a reconnect breaks the stream)
        self.broken = False  # the stream broke since the last take
        self.replayed = 0  # batches recovered through the replay socket
        self.missed = 0  # batches neither stream nor replay delivered
        self.undecodable = 0  # payloads that are not a vLLM KVEventBatch
        self._form = "map"  # the form its last events came in (vllm_event_schema.SCHEMAS): tried first
        self._catch_up = False  # request_catch_up() was called: the next take replays from 0

    def take(self, timeout_ms: int = 0) -> list[VllmEventBatch]:
        """The batches that arrived (waiting up to ``timeout_ms`` for the first); clears
        and sets ``broken`` (see the class docstring)."""
        self.broken = False
        out: list[VllmEventBatch] = []
        if self._catch_up:
            self._catch_up = False
            self.next_seq = None
            out.extend(self._replay(0, 1 << 62, catch_up=True))
        events = dict(self._poller.poll(timeout_ms))
        while events:
            if self._monitor in events:
                while (catch_up := self._monitor_event(out)) is not None:
                    if catch_up:
                        out.extend(self._replay(0, 1 << 62, catch_up=True))
            while self._sub.poll(0):
                if (gap := self._receive(self._sub.recv_multipart())) is not None:
                    if gap[0] > self.next_seq:
                        out.extend(self._replay(self.next_seq, gap[0]))
                    self._accept(*gap, out)
            events = dict(self._poller.poll(0))
        return out

    async def take_async(self, timeout_s: float | None = None) -> list[VllmEventBatch]:
        """``take`` on the event loop: waits (up to ``timeout_s``; None: until the stream
        has something) without a thread, and replays without blocking the loop."""
        self.broken = False
        out: list[VllmEventBatch] = []
        if self._catch_up:
            self._catch_up = False
            self.next_seq = None
            out.extend(await self._replay_async(0, 1 << 62, catch_up=True))
        if not out:
            await self._readable(timeout_s)
        frames = 0
        sub, monitor = self._sub, self._monitor
        while frames < self.MAX_FRAMES_PER_TAKE and (self._has_input(sub) or self._has_input(monitor)):
            while (catch_up := self._monitor_event(out)) is not None:
                if catch_up:
                    out.extend(await self._replay_async(0, 1 << 62, catch_up=True))
            while frames < self.MAX_FRAMES_PER_TAKE and self._has_input(sub):
                frames += 1
                if (gap := self._receive(self._sub.recv_multipart())) is not None:
                    if gap[0] > self.next_seq:
                        out.extend(await self._replay_async(self.next_seq, gap[0]))
                    self._accept(*gap, out)
        return out

    def _has_input(self, sock) -> bool:
        """Whether ``sock`` has a message to read now (zmq's EVENTS: cheaper than a poll,
        and it also drains the socket's FD signal, so a later message signals anew)."""
        return bool(sock.getsockopt(self._zmq.EVENTS) & self._zmq.POLLIN)

    async def _readable(self, timeout_s: float | None) -> None:
        """Wait (up to ``timeout_s``; None: as long as it takes) until either socket may
        have input. A zmq socket's FD is edge-triggered: it signals a change in the
        socket's state, not that a message waits. So the wake-up is cleared first and the
        sockets' EVENTS read after: a message already there returns at once, and any later
        one signals the FD, whose reader sets the wake-up."""
        if self._wake is None:
            loop = self._reader_loop = asyncio.get_running_loop()
            wake = self._wake = asyncio.Event()
            for sock in (self._sub, self._monitor):
                loop.add_reader(sock.getsockopt(self._zmq.FD), wake.set)
        self._wake.clear()
        if self._has_input(self._sub) or self._has_input(self._monitor):
            return
        if timeout_s is None:
            await self._wake.wait()
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        except TimeoutError:
            pass

    def request_catch_up(self) -> None:
        """Make the next take start over from the server's replay buffer (a consumer
        that dropped what it built, after an impossible claim, resyncs this way)."""
        self._catch_up = True

    def _break(self, out: list) -> None:
        self.broken = True
        self.next_seq = None
        out.clear()

    def _monitor_event(self, out: list) -> bool | None:
        """Handle one pending monitor event; returns None when none is pending, else
        whether the stream must now catch up from the replay buffer (it connected)."""
        from zmq.utils.monitor import recv_monitor_message

        if not self._has_input(self._monitor):
            return None
        msg = recv_monitor_message(self._monitor)
        if msg["event"] == self._zmq.EVENT_CONNECTED:
            self.connected = True
            self.connects += 1
            if self.connects > 1:
                self._break(out)
            # NOTE: catch up at once from the server's replay buffer, so a router that
            # connects late (or again) knows what the server cached before.
            return True
        if msg["event"] == self._zmq.EVENT_DISCONNECTED:
            self.connected = False
        return False

    def _receive(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """A stream message's (seq, payload), or None when it is to be skipped (already
        replayed, or not a 3-frame message); a seq above ``next_seq`` is a gap for the
        caller to replay before ``_accept``."""
        if len(frames) != 3:
            self.undecodable += 1
            return None
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self.next_seq is None:
            # NOTE: the first batch seen: replay what the server still buffers before it, so a
            # router that joins late rebuilds this server's cache from its history.
            self.next_seq = 0
        if seq < self.next_seq:
            return None  # already replayed
        return seq, payload

    def _accept(self, seq: int, payload: bytes, out: list[VllmEventBatch]) -> None:
        if seq > self.next_seq:  # replay could not fill the gap
            self.missed += seq - self.next_seq
            self._break(out)
        self._decode_into(payload, out)
        self.next_seq = seq + 1

    def _decode_into(self, payload: bytes, out: list[VllmEventBatch]) -> None:
        try:
            # NOTE: the form this server's last events came in is tried first: a stream of
            # the older array form does not pay a failed map decode per batch.
            batch = decode_batch(payload, self._form)
        except msgspec.DecodeError:
            self.undecodable += 1
            return
        self._form = schema_of(batch) or self._form
        out.append(batch)

    def _replay_socket(self, start: int):
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        return sock

    def _replayed(self, frames: list[bytes], start: int, stop: int, catch_up: bool, got: list) -> bool:
        """Take one replay answer into ``got``; False at the end of the answer."""
        if len(frames) != 4:
            return False
        _empty, _topic, seq_bytes, payload = frames
        if seq_bytes == END_SEQ:
            return False
        seq = int.from_bytes(seq_bytes, "big")
        if catch_up and self.next_seq is None:
            self.next_seq = seq  # the buffer's oldest: what came before is gone
        if start <= seq < stop and seq == self.next_seq:
            self._decode_into(payload, got)
            self.next_seq = seq + 1
        return True

    def _replay(self, start: int, stop: int, catch_up: bool = False) -> list[VllmEventBatch]:
        """Batches ``start .. stop-1`` from the server's replay buffer (as many as it has);
        ``catch_up``: the stream starts at the buffer's oldest batch (``next_seq`` unset)."""
        if not self._replay_endpoint:
            return []
        got: list[VllmEventBatch] = []
        sock = self._replay_socket(start)
        try:
            while sock.poll(self._replay_timeout_ms) and self._replayed(sock.recv_multipart(), start, stop, catch_up, got):
                pass
            self.replayed += len(got)
        finally:
            sock.close(0)
        return got

    async def _replay_async(self, start: int, stop: int, catch_up: bool = False) -> list[VllmEventBatch]:
        """``_replay`` awaiting the server's answer on the event loop."""
        import zmq.asyncio

        if not self._replay_endpoint:
            return []
        got: list[VllmEventBatch] = []
        sock = zmq.asyncio.Socket.from_socket(self._replay_socket(start))
        try:
            while await sock.poll(self._replay_timeout_ms):
                if not self._replayed(await sock.recv_multipart(), start, stop, catch_up, got):
                    break
            self.replayed += len(got)
        finally:
            sock.close(0)
        return got

    def close(self) -> None:
        loop = self._reader_loop
        if loop is not None and not loop.is_closed():
            for sock in (self._sub, self._monitor):
                loop.remove_reader(sock.getsockopt(self._zmq.FD))  # before the socket (and its FD) closes
        self._reader_loop = self._wake = None
        self._sub.disable_monitor()
        self._monitor.close(0)
        self._sub.close(0)
