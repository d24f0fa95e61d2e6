"""Writes to one stream transport, coalesced per event-loop iteration.

Used by the replica hop at both ends (``unicache.contract.hop``: frames) and by the router's HTTP
front door (``unicache.router.frontends.http_server``: a response's head and SSE events). A send per
write costs a system call, and on loopback the sender also pays for the receiver's TCP
processing: in the HTTP front door, before this, a third of the router's CPU per streamed
request was ``transport.write`` (an 8-token stream made 11 of them).
"""

from __future__ import annotations


class CoalescingWriter:
    """Writes to ``transport``: the first of an event-loop iteration leaves at once, the
    ones after it in that iteration together in one ``transport.write`` (one send) at the
    start of the next. A replica's engine step wakes every stream it made a token for in
    the same iteration, and a burst of requests starts together, so a send per write would
    cost a system call (and a wake-up of the peer) per write; the first write never waits,
    so a lone message is as fast as with a send per write.

    ``hold(data)`` keeps ``data`` for the next write of this iteration, which takes it
    along in its send (an HTTP response's head, then its first body chunk: one send, and
    the chunk does not wait); if no write follows, it leaves at the start of the next
    iteration.

    Invariants:
        * Data leaves in the order written or held (an empty write is no write); none waits past the start of the next
          loop iteration (``call_soon``), and nothing waits for more data.
        * ``flush()`` writes what is pending now; ``close()`` flushes, then closes the
          transport (a refusal written just before still reaches the peer).
        * Once the transport is closing, pending and later writes are dropped.
    """

    __slots__ = ("transport", "_parts", "_armed", "_scheduled", "_loop")

    def __init__(self, transport, loop):
        self.transport = transport
        self._parts: list[bytes] = []
        self._armed = False  # a write left in this iteration: later ones wait for the flush
        self._scheduled = False  # a flush at the start of the next iteration is scheduled
        self._loop = loop

    def write(self, data: bytes) -> None:
        if not data:  # nothing to send (h11 writes an empty chunk before a stream's end)
            return
        if self._armed:
            self._parts.append(data)
            return
        self._armed = True
        self._schedule()
        if self._parts:  # held data goes first, in the same send
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts = []
        if not self.transport.is_closing():
            self.transport.write(data)

    def hold(self, data: bytes) -> None:
        self._parts.append(data)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._scheduled = False
        self._armed = False
        self.flush()

    def flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        self._parts = []
        if not self.transport.is_closing():
            self.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        if not self.transport.is_closing():
            self.transport.close()
