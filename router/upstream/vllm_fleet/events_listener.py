"""``--kv-events-listen tcp://*:PORT``: one bound SUB socket that any number of vLLM servers
publish their KV events to, each stream told apart by its topic.

vLLM binds its events socket only for a wildcard endpoint (``tcp://*:5557``); given a host
address (``--kv-events-config '{"endpoint": "tcp://ROUTER:PORT", ...}'``) it connects out to
a listener instead, which is how llm-d deploys it. The router then binds this socket and
every server's multipart ``(topic, seq, payload)`` arrives on it. A backend claims:

* its ``kv-topic=`` when given (``--backend URL,kv-topic=TOPIC``), else
* its id (``vllm-<host>-<port>``, or ``id=``): our convention, vLLM started with
  ``"topic": "<backend id>"``, and
* llm-d's ``kv@<pod-ip>@<model>``: any topic whose address is its URL's host.

Each claimed stream is a ``TopicStream``: the ``KVEventSubscriber`` interface the follower
reads (``take_async``, ``broken``, ``connected``, ``request_catch_up``), with the same seq
and replay rules, fed by the listener instead of a socket of its own. Where the backend has
a replay endpoint (``replay=tcp://HOST:PORT``; vLLM binds its replay socket whatever the
events endpoint) the stream catches up from it before the first batch and fills gaps from it.

Invariants:
    * One SUB socket and one receiving task on the event loop for every stream (no thread
      per stream); a frame is handed to at most one stream; topics nobody claims are
      counted (``unclaimed``) and logged once each.
    * A stream is ``connected`` once a batch came on its topic or its replay socket
      answered; a server that starts over (seq 0 again after later batches: a restart)
      breaks the stream, as a reconnect does for a subscriber. The listener cannot see a
      publisher leave: a silent stream stays connected (the follower's health polls judge
      the server).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from urllib.parse import urlsplit

from unicache.contract.vllm_events import KVEventSubscriber, VllmEventBatch
from unicache.plumbing.errors import UsageError
from unicache.router.upstream.vllm_fleet.spec import BackendSpec

log = logging.getLogger(__name__)

LLMD_PREFIX = "kv@"  # llm-d's topics: kv@<pod-ip>@<model>


def parse_listen(endpoint: str) -> str:
    """A ``kv_events_listen`` value, checked: ``tcp://*:PORT`` or ``tcp://ADDRESS:PORT``."""
    parts = urlsplit(endpoint)
    host = parts.netloc.rpartition(":")[0]
    port = parts.netloc.rpartition(":")[2]
    if parts.scheme != "tcp" or not host or not port.isdigit() or parts.path or parts.query:
        raise UsageError(f"kv_events_listen {endpoint!r}: expected tcp://*:PORT (or tcp://ADDRESS:PORT) to bind")
    return endpoint


def llmd_host(topic: str) -> str:
    """The pod address of an llm-d topic ``kv@<pod-ip>@<model>`` ("" for another topic)."""
    if not topic.startswith(LLMD_PREFIX):
        return ""
    host, sep, _model = topic[len(LLMD_PREFIX):].partition("@")
    return host.strip("[]") if sep else ""


class TopicStream(KVEventSubscriber):
    """One backend's events on the listener (see the module docstring); its seq, gap and
    replay handling are ``KVEventSubscriber``'s.

    Args:
        listener: the listener that feeds it.
        topics: the exact topics it claims.
        host: the address it claims llm-d topics of ("": none).
        replay_endpoint: the server's replay ROUTER ("": none).
        replay_timeout_ms: deadline of one replay exchange.
        retry_s: how often an unconnected stream asks the replay socket again.
    """

    def __init__(self, listener: EventsListener, topics: tuple[str, ...], host: str, replay_endpoint: str = "",
                 replay_timeout_ms: int = 1000, retry_s: float = 1.0):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._listener = listener
        self.topics = topics
        self.host = host
        self.endpoint = f"{listener.endpoint} (topic {' or '.join(topics)}{f' or kv@{host}@<model>' if host else ''})"
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self.retry_s = retry_s
        self.next_seq: int | None = None
        self.connected = False
        self.connects = 0
        self.broken = False
        self.replayed = 0
        self.missed = 0
        self.undecodable = 0
        self._form = "map"
        self.restarts = 0  # times the server started its seq over
        self._catch_up = False
        self._frames: deque[tuple[bytes, bytes]] = deque()
        self._wake = asyncio.Event()

    def feed(self, seq_bytes: bytes, payload: bytes) -> None:
        """A frame the listener received on one of this stream's topics."""
        self._frames.append((seq_bytes, payload))
        self._wake.set()

    def take(self, timeout_ms: int = 0) -> list[VllmEventBatch]:
        raise TypeError("a listener's stream is read with take_async")

    async def take_async(self, timeout_s: float | None = None) -> list[VllmEventBatch]:
        """The batches that arrived on its topics (waiting up to ``timeout_s``), replays
        included; clears and sets ``broken``."""
        self.broken = False
        out: list[VllmEventBatch] = []
        if self._catch_up or (not self.connected and self._replay_endpoint):
            # NOTE: until it answers (the server may not be up yet) the replay socket is
            # asked every retry_s: an idle server publishes nothing, and its answer is what
            # tells the follower the stream is there.
            self._catch_up = False
            self.next_seq = None
            answered, got = await self._ask_replay(0, 1 << 62, catch_up=True)
            out.extend(got)
            if answered and not self.connected:
                self._connected()
        if not out and not self._frames:
            if not self.connected and self._replay_endpoint:
                timeout_s = self.retry_s if timeout_s is None else min(timeout_s, self.retry_s)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except TimeoutError:
                pass
        n = 0
        while self._frames and n < self.MAX_FRAMES_PER_TAKE:
            seq_bytes, payload = self._frames.popleft()
            n += 1
            if not self.connected:
                self._connected()
            seq = int.from_bytes(seq_bytes, "big")
            if seq == 0 and self.next_seq:  # the server started over: its cache is empty
                self.restarts += 1
                self._break(out)
            if (gap := self._receive([b"", seq_bytes, payload])) is not None:
                if gap[0] > self.next_seq:
                    out.extend((await self._ask_replay(self.next_seq, gap[0]))[1])
                self._accept(*gap, out)
        return out

    def _connected(self) -> None:
        self.connected = True
        self.connects += 1
        log.info("KV events of %s arrive on the listener", self.endpoint)

    async def _ask_replay(self, start: int, stop: int, catch_up: bool = False) -> tuple[bool, list[VllmEventBatch]]:
        """``_replay_async``, and whether the replay socket answered at all."""
        self._answered = False
        got = await self._replay_async(start, stop, catch_up)
        return self._answered, got

    def _replayed(self, frames: list[bytes], start: int, stop: int, catch_up: bool, got: list) -> bool:
        self._answered = True
        return super()._replayed(frames, start, stop, catch_up, got)

    def close(self) -> None:
        self._listener.release(self)


class EventsListener:
    """The bound SUB socket and its receiving task (see the module docstring).

    Args:
        endpoint: where to bind (``tcp://*:PORT``).
    """

    def __init__(self, endpoint: str):
        import zmq
        import zmq.asyncio

        self.endpoint = parse_listen(endpoint)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # never drop: the task reads as frames come
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise UsageError(f"kv_events_listen {endpoint!r}: cannot bind ({exc})") from None
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port when PORT was 0
        if self.endpoint.endswith(":0"):
            self.endpoint = self.bound
        self._sock = zmq.asyncio.Socket.from_socket(sock)
        self._raw = sock
        self._by_topic: dict[str, TopicStream] = {}
        self._by_host: dict[str, TopicStream] = {}
        self.unclaimed: dict[str, int] = {}  # topic -> frames nobody claimed
        self.frames = 0
        self._task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return int(self.bound.rpartition(":")[2])

    def stream(self, spec: BackendSpec, **kwargs) -> TopicStream:
        """The stream of backend ``spec`` (its topics: the module docstring); starts the
        receiving task on the running loop if it is not running."""
        topics = (spec.topic,) if spec.topic else (spec.backend_id,)
        host = "" if spec.topic else (urlsplit(spec.url).hostname or "")
        for t in topics:
            if t in self._by_topic:
                raise UsageError(f"two backends claim the KV events topic {t!r} on {self.endpoint}")
        s = TopicStream(self, topics, host, spec.replay, **kwargs)
        for t in topics:
            self._by_topic[t] = s
        if host:
            self._by_host.setdefault(host, s)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kv-events-listener")
        return s

    def release(self, s: TopicStream) -> None:
        for t in s.topics:
            if self._by_topic.get(t) is s:
                del self._by_topic[t]
        if self._by_host.get(s.host) is s:
            del self._by_host[s.host]

    def claimant(self, topic: str) -> TopicStream | None:
        return self._by_topic.get(topic) or self._by_host.get(llmd_host(topic))

    async def run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.frames += 1
            if len(frames) != 3:
                continue
            topic = frames[0].decode("utf-8", "replace")
            s = self.claimant(topic)
            if s is not None:
                s.feed(frames[1], frames[2])
                continue
            n = self.unclaimed[topic] = self.unclaimed.get(topic, 0) + 1
            if n == 1:
                log.warning("KV events on %s with topic %r match no backend: give the backend kv-topic=%s, or start vLLM "
                            "with its backend id as topic (or llm-d's kv@<pod-ip>@<model>)", self.endpoint, topic, topic)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock._clear_io_state()
        self._raw.close(0)
