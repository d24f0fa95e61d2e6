"""``--kv-events-listen`` (router/upstream/vllm_fleet/events_listener.py): one bound SUB socket,
several fake vLLM publishers connecting to it (PUB + replay ROUTER, as vLLM's
``ZmqEventPublisher`` with a host endpoint), streams told apart by topic, caught up and
gap-filled from each one's replay socket; and the one log line a backend gets when its
events never come."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from unicache.plumbing.errors import UsageError
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.config import RouterConfig
from unicache.router.routing.registry import make_routing_policy
from unicache.router.upstream.vllm_fleet.events_listener import EventsListener, llmd_host, parse_listen
from unicache.router.upstream.vllm_fleet.follower import BackendFollower
from unicache.router.upstream.vllm_fleet.spec import BackendSpec, parse_backend

RECORDINGS = Path(__file__).parents[1] / "support" / "vllm_events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def recorded(release: str) -> list[bytes]:
    return msgspec.msgpack.decode((RECORDINGS / f"{release}.msgpack").read_bytes())


class FakePublisher:
    """vLLM's publisher given a host endpoint: PUB connects to the listener, the replay
    ROUTER binds; every batch is buffered for replay."""

    def __init__(self, listen: str, topic: str, replay: bool = True):
        ctx = zmq.asyncio.Context.instance()
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(listen)
        self.replay = None
        self.replay_endpoint = ""
        if replay:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            port = self.replay.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._task = asyncio.create_task(self._serve()) if replay else None

    async def publish(self, payload: bytes, send: bool = True) -> None:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def _serve(self) -> None:
        while True:
            client, _empty, start = await self.replay.recv_multipart()
            for seq, buf in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), buf))
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self.replay.close(0)
        self.pub.close(0)


async def take_until(stream, n: int, timeout_s: float = 10.0) -> list:
    got: list = []
    async with asyncio.timeout(timeout_s):
        while len(got) < n:
            got.extend(await stream.take_async(0.5))
    return got


async def test_two_servers_publish_to_one_socket_each_stream_in_order_with_replay():
    listener = EventsListener("tcp://127.0.0.1:0")
    endpoint = listener.bound
    a = FakePublisher(endpoint, "vllm-a")  # our convention: the backend id
    b = FakePublisher(endpoint, "kv@10.0.0.7@tiny-llama")  # llm-d's, the array form of 0.23
    stray = FakePublisher(endpoint, "kv@10.9.9.9@other", replay=False)
    try:
        m, arr = recorded("0.32.0"), recorded("0.23.0")
        # before anyone listens: batches only the replay buffer keeps
        await a.publish(m[0], send=False)
        await a.publish(m[1], send=False)
        sa = listener.stream(BackendSpec("vllm-a", "http://a.example:8000", replay=a.replay_endpoint))
        sb = listener.stream(parse_backend(f"http://10.0.0.7:8000,replay={b.replay_endpoint}"))
        assert (sa.connected, sb.connected) == (False, False)
        first = await sa.take_async(1.0)  # caught up from the replay socket: connected
        assert (sa.connected, [x.ts for x in first]) == (True, [1000.0, 1001.0])
        await asyncio.sleep(0.3)  # the publishers' connections settle (PUB drops until then)
        for p in arr:
            await b.publish(p)
        await a.publish(m[2])
        got_b = await take_until(sb, len(arr))
        assert [x.ts for x in got_b] == [1000.0 + i for i in range(len(arr))]
        assert (await take_until(sa, 1))[0].ts == 1002.0
        # a batch lost on the way (not sent) comes back through the gap replay
        await a.publish(m[3], send=False)
        await a.publish(m[4])
        assert [x.ts for x in await take_until(sa, 2)] == [1003.0, 1004.0]
        assert (sa.replayed, sa.missed, sa.broken) == (3, 0, False)  # 2 caught up, 1 gap filled
        # a server that starts over (a restart) breaks its stream
        a.seq, a.buffer = 0, []
        await a.publish(m[0])
        got = await take_until(sa, 1)
        assert ([x.ts for x in got], sa.broken, sa.restarts) == ([1000.0], True, 1)
        async with asyncio.timeout(10):
            while not listener.unclaimed:  # a PUB drops what it sends before its connection is up
                await stray.publish(m[0])
                await asyncio.sleep(0.1)
        assert list(listener.unclaimed) == ["kv@10.9.9.9@other"]
        with pytest.raises(UsageError, match="two backends claim the KV events topic 'vllm-a'"):
            listener.stream(BackendSpec("x", "http://x:1", topic="vllm-a"))
        sa.close()
        assert listener.claimant("vllm-a") is None and listener.claimant("kv@10.0.0.7@m") is sb
    finally:
        for p in (a, b, stray):
            p.close()
        listener.close()


def test_topics_endpoints_and_settings_are_checked_by_name():
    assert llmd_host("kv@10.1.2.3@meta-llama/Llama-3.1-8B") == "10.1.2.3"
    assert llmd_host("kv@[fd00::1]@m") == "fd00::1"
    assert (llmd_host("vllm-a"), llmd_host("kv@nomodel")) == ("", "")
    assert parse_listen("tcp://*:5557") == "tcp://*:5557"
    for bad in ("tcp://*", "ipc:///tmp/x", "tcp://*:port", "5557"):
        with pytest.raises(UsageError, match="expected tcp://\\*:PORT"):
            parse_listen(bad)
    spec = parse_backend("http://h:8000,kv-topic=kv@h@m,replay=tcp://h:5558")
    assert (spec.topic, spec.replay, spec.events) == ("kv@h@m", "tcp://h:5558", "")
    with pytest.raises(UsageError, match="exclude each other"):
        parse_backend("http://h:8000,kv-topic=t,kv-events=tcp://h:5557")
    RouterConfig(kv_events_listen="tcp://*:5557").validate()
    with pytest.raises(UsageError, match="run it with --workers 1"):
        RouterConfig(kv_events_listen="tcp://*:5557", workers=2, grpc_port=1, http_port=2).validate()
    with pytest.raises(UsageError, match="kv_events_listen 'udp://x'"):
        RouterConfig(kv_events_listen="udp://x").validate()


class _NoHttp:
    models: dict = {}


def follower(spec: BackendSpec, **kwargs) -> BackendFollower:
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    return BackendFollower(spec, cluster, _NoHttp(), 16, events_wait_s=0.0, **kwargs)


async def test_an_events_address_with_no_publisher_gets_one_line_saying_what_to_check(caplog):
    caplog.set_level(logging.WARNING, logger="unicache.router.upstream.vllm_fleet.follower")
    f = follower(BackendSpec("b", "http://10.0.0.9:8000", "tcp://127.0.0.1:9"))  # nothing binds there
    try:
        assert [f._events_overdue() for _ in range(3)] == [False] * 3
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("backend b (http://10.0.0.9:8000) not routable: no publisher at tcp://127.0.0.1:9 after 0s.")
        assert 'vLLM binds its events socket only for a wildcard endpoint ("endpoint": "tcp://*:9")' in line
        assert "--kv-events-listen tcp://*:PORT" in line
    finally:
        f.subscriber.close()


async def test_a_listened_backend_without_events_joins_after_one_line(caplog):
    caplog.set_level(logging.WARNING, logger="unicache.router.upstream.vllm_fleet.follower")
    listener = EventsListener("tcp://127.0.0.1:0")
    try:
        f = follower(BackendSpec("vllm-q", "http://10.0.0.8:8000"), listener=listener)
        assert [f._events_overdue() for _ in range(2)] == [True, True]
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"backend vllm-q (http://10.0.0.8:8000): no KV events on {listener.endpoint} (topic vllm-q or "
                               "kv@10.0.0.8@<model>) after 0s; it joins without them.")
        assert f"endpoint tcp://<router address>:{listener.port}" in line
    finally:
        listener.close()
