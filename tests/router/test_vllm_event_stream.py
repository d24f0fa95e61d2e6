"""A vLLM server's KV-event stream followed on the event loop (``KVEventSubscriber.take_async``
and ``BackendFollower``'s events loop): catch-up from the replay buffer, gaps filled by
replay without blocking the loop, a gap replay cannot fill breaks the stream, a
disconnected stream ages its blocks out, and no thread is used while waiting.

The fake server below speaks vLLM's wire (PUB ``(topic, seq, payload)``, replay ROUTER
answering ``(b"", start)`` with ``(b"", topic, seq, payload)`` frames then ``END_SEQ``),
and runs on the test's own event loop: a replay that blocked the loop could never be
answered.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import zmq
import zmq.asyncio

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.vllm_events import END_SEQ, KVEventSubscriber, VllmBlockStored, VllmEventBatch
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.registry import make_routing_policy
from unicache.router.upstream.vllm_fleet.follower import BackendFollower
from unicache.router.upstream.vllm_fleet.http_stream import VllmClients
from unicache.router.upstream.vllm_fleet.spec import BackendSpec
from unicache.testing.polling import eventually

BS = 4
TOPIC = b"kv-events"


class FakeVllmEvents:
    """A vLLM server's event publisher and replay buffer, on the running loop."""

    def __init__(self):
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # vLLM's is a PUB; XPUB also tells when a subscriber joined
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self.seq = 0
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    @property
    def endpoints(self) -> tuple[str, str]:
        return f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}"

    async def subscribed(self) -> None:
        """Wait until the subscriber's subscription reached the publisher (a PUB drops
        what it sends before)."""
        assert (await self.pub.recv())[:1] == b"\x01"

    async def publish(self, batch: VllmEventBatch, send: bool = True, keep: bool = True) -> int:
        """Publish the next batch (``send=False``: lost on the way; ``keep=False``: gone
        from the replay buffer too)."""
        seq, self.seq = self.seq, self.seq + 1
        payload = msgspec.msgpack.encode(batch)
        if keep:
            self.buffer[seq] = payload
        if send:
            await self.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))
        return seq

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start = await self.replay.recv_multipart()
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            for seq in sorted(s for s in self.buffer if s >= start):
                await self.replay.send_multipart((ident, b"", TOPIC, seq.to_bytes(8, "big"), self.buffer[seq]))
            await self.replay.send_multipart((ident, b"", TOPIC, END_SEQ, b""))

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        self.replay.close(0)
        self.ctx.term()


def marked(n: int) -> VllmEventBatch:
    """An empty batch whose timestamp names it."""
    return VllmEventBatch(ts=float(n), events=[])


async def take_until(sub: KVEventSubscriber, n: int) -> tuple[list[float], bool]:
    """Batches (their timestamps) until ``n`` have come, and whether the stream broke."""
    got: list[float] = []
    broken = False
    for _ in range(200):
        got.extend(b.ts for b in await sub.take_async(5.0))
        broken |= sub.broken
        if len(got) >= n:
            return got, broken
    raise AssertionError(f"only {got} arrived")


async def test_take_async_catches_up_fills_gaps_by_replay_and_breaks_on_a_lost_batch():
    server = FakeVllmEvents()
    sub = KVEventSubscriber(*server.endpoints)
    try:
        await server.publish(marked(0), send=False)  # before the router connected: replay has them
        await server.publish(marked(1), send=False)
        assert await take_until(sub, 2) == ([0.0, 1.0], False)
        assert (sub.connected, sub.connects, sub.next_seq, server.replay_requests) == (True, 1, 2, [0])

        await server.subscribed()
        await server.publish(marked(2), send=False)  # lost on the way, still in the buffer
        await server.publish(marked(3))
        assert await take_until(sub, 2) == ([2.0, 3.0], False)
        assert (sub.replayed, sub.missed, server.replay_requests[-1]) == (3, 0, 2)

        await server.publish(marked(4), send=False, keep=False)  # lost everywhere
        await server.publish(marked(5))
        assert await take_until(sub, 1) == ([5.0], True)
        assert (sub.missed, sub.next_seq) == (1, 6)
    finally:
        sub.close()
        await server.close()


async def test_the_synchronous_take_has_the_same_stream_semantics():
    server = FakeVllmEvents()
    sub = KVEventSubscriber(*server.endpoints)  # the in-process replica's way (here in a thread:
    try:  # the fake server answers replays on this loop)
        await server.publish(marked(0), send=False)
        got: list[float] = []
        while len(got) < 1:
            got.extend(b.ts for b in await asyncio.to_thread(sub.take, 100))
        await server.subscribed()
        await server.publish(marked(1), send=False)
        await server.publish(marked(2))
        while 2.0 not in got:
            got.extend(b.ts for b in await asyncio.to_thread(sub.take, 100))
            assert not sub.broken
        assert (got, sub.replayed) == ([0.0, 1.0, 2.0], 2)
        await server.publish(marked(3), send=False, keep=False)
        await server.publish(marked(4))
        after: list[float] = []
        while 4.0 not in after:
            after.extend(b.ts for b in await asyncio.to_thread(sub.take, 100))
        assert (after, sub.broken, sub.missed) == ([4.0], True, 1)
    finally:
        sub.close()
        await server.close()


async def test_an_idle_stream_waits_on_the_loop_without_a_thread():
    server = FakeVllmEvents()
    sub = KVEventSubscriber(*server.endpoints)
    before = {t.ident for t in threading.enumerate()}
    try:
        while not sub.connected:  # the catch-up finds an empty buffer
            assert await sub.take_async(5.0) == []
        await server.subscribed()
        waiter = asyncio.create_task(sub.take_async())  # no deadline: until something comes
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await server.publish(marked(0))
        assert [b.ts for b in await asyncio.wait_for(waiter, 10)] == [0.0]
        assert {t.ident for t in threading.enumerate()} - before == set()
    finally:
        sub.close()
        await server.close()


async def test_batches_that_arrive_between_takes_are_taken_without_a_new_signal():
    """A zmq socket's FD signals a change, not a waiting message: batches that arrived while
    nobody waited (their signal already seen by the loop) are still taken at once."""
    server = FakeVllmEvents()
    sub = KVEventSubscriber(*server.endpoints)
    try:
        while not sub.connected:
            assert await sub.take_async(5.0) == []
        await server.subscribed()
        await server.publish(marked(0))
        assert [b.ts for b in await asyncio.wait_for(sub.take_async(), 10)] == [0.0]
        await server.publish(marked(1))
        await server.publish(marked(2))
        await asyncio.sleep(0.2)  # both arrive, and the loop sees their signal, before the next take
        got: list[float] = []
        while len(got) < 2:  # no deadline: a take that missed them would wait for good
            got.extend(b.ts for b in await asyncio.wait_for(sub.take_async(), 10))
        assert got == [1.0, 2.0] and not sub.broken
    finally:
        sub.close()
        await server.close()


def follower_for(server: FakeVllmEvents, stale_after_s: float = 10.0) -> tuple[BackendFollower, ClusterView]:
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    spec = BackendSpec("b", "http://127.0.0.1:1", *server.endpoints)
    return BackendFollower(spec, cluster, VllmClients(), BS, stale_after_s=stale_after_s), cluster


async def test_the_follower_indexes_the_stream_and_ages_it_out_when_disconnected():
    server = FakeVllmEvents()
    follower, cluster = follower_for(server, stale_after_s=0.3)
    toks = list(range(8))
    hashes = hash_token_blocks(toks, BS)
    await server.publish(VllmEventBatch(ts=1.0, events=[VllmBlockStored([11, 12], None, toks, BS, medium="GPU")]), send=False)
    task = asyncio.create_task(follower._events_loop())
    try:
        await eventually(lambda: cluster.index.match("b", hashes) == 2, "the replayed blocks in the index")
        assert (follower.caught_up, follower.batches, follower.breaks) == (True, 1, 0)
        await server.close()  # the server goes away: its blocks leave once stale_after_s has passed
        await eventually(lambda: cluster.index.num_blocks("b") == 0, "the blocks aged out")
        assert (follower.caught_up, len(follower.translator)) == (False, 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        follower.subscriber.close()
