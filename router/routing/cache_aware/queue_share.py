"""The queue share: how much of a replica's published prefill queue still has to be computed.

A replica publishes its queue as the whole prompts of its requests without a first token,
cached parts included (an engine learns a request's match only when it schedules it).
``cache_aware`` keeps, per replica, the uncached tokens (by the index, at routing) and the
whole prompt tokens of the requests it routed there that have not sent their first token,
adds the other routers' sums (the terms exchange), and scales the replica's published
queue by the ratio of the totals (``share``).

Invariants:
    * ``requests`` holds at most ``max_requests`` requests, each routed and without its
      first token yet (the oldest dropped first); ``own[r]`` sums the uncached and whole
      prompt tokens of those routed to r, present only while the whole sum is positive.
    * ``share[r]`` is the ratio of the uncached to the whole tokens of ``own[r]`` and
      ``peer[r]`` together, present only while the whole total is positive; the dict is
      changed in place, never replaced (a caller may hold it).
    * ``changed`` is None until ``track_changes``; then it holds the replicas whose own
      sums moved since ``take_changes`` (a lone router, whose changes nobody takes, keeps
      none rather than every replica id ever seen).
"""

from __future__ import annotations

from collections import OrderedDict


class QueueShares:
    """One router's queued prompt tokens per replica and the shares they give (see the
    module docstring)."""

    __slots__ = ("max_requests", "requests", "own", "peer", "share", "changed")

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.requests: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # id -> (replica, uncached, whole)
        self.own: dict[str, list[int]] = {}  # replica -> [uncached, whole]
        self.peer: dict[str, tuple[int, int]] = {}  # replica -> the other routers' (uncached, whole)
        self.share: dict[str, float] = {}
        self.changed: set[str] | None = None

    def track_changes(self) -> None:
        if self.changed is None:
            self.changed = set()

    def add(self, request_id: str, replica_id: str, uncached: int, whole: int) -> None:
        """Count a request routed to ``replica_id`` as waiting for its first token there
        (a retry's earlier attempt is replaced; the oldest dropped beyond ``max_requests``)."""
        self.remove(request_id)
        self.requests[request_id] = (replica_id, uncached, whole)
        self._move(replica_id, uncached, whole)
        while len(self.requests) > self.max_requests:
            self.remove(next(iter(self.requests)))

    def remove(self, request_id: str) -> None:
        """The request sent its first token, finished or was dropped (nothing if unknown)."""
        q = self.requests.pop(request_id, None)
        if q is not None:
            self._move(q[0], -q[1], -q[2])

    def _move(self, replica_id: str, d_uncached: int, d_whole: int) -> None:
        """Move ``replica_id``'s sums by the deltas (dropped at 0) and its share with them."""
        own = self.own
        t = own.get(replica_id)
        if t is None:
            t = own[replica_id] = [0, 0]
        t[0] += d_uncached
        t[1] += d_whole
        if t[1] <= 0:
            del own[replica_id]
        if self.changed is not None:
            self.changed.add(replica_id)
        self._reshare(replica_id)

    def _reshare(self, replica_id: str) -> None:
        own = self.own.get(replica_id)
        peer = self.peer.get(replica_id)
        unc = (own[0] if own else 0) + (peer[0] if peer else 0)
        whole = (own[1] if own else 0) + (peer[1] if peer else 0)
        if whole > 0:
            self.share[replica_id] = unc / whole
        else:
            self.share.pop(replica_id, None)

    def own_sums(self) -> dict[str, tuple[int, int]]:
        return {rid: (t[0], t[1]) for rid, t in self.own.items()}

    def take_changes(self) -> dict[str, tuple[int, int]]:
        """The own sums of the replicas changed since the last call ((0, 0): none left)."""
        changed = self.changed
        if not changed:
            return {}
        self.changed = set()
        get = self.own.get
        return {rid: ((t[0], t[1]) if (t := get(rid)) is not None else (0, 0)) for rid in changed}

    def set_peer(self, totals: dict[str, tuple[int, int]]) -> None:
        """The other routers' sums now (replacing the last); only the replicas whose totals
        moved are reshared (a 50 ms round at 1,024 replicas changes a few dozen of them)."""
        old, get = self.peer, self.peer.get
        moved = [rid for rid, t in totals.items() if get(rid) != t]
        moved += [rid for rid in old if rid not in totals]
        self.peer = dict(totals)
        for rid in moved:
            self._reshare(rid)

    def drop_replica(self, replica_id: str) -> None:
        """The replica left: its requests and the other routers' sums for it go."""
        for request_id in [k for k, q in self.requests.items() if q[0] == replica_id]:
            self.remove(request_id)
        if self.peer.pop(replica_id, None) is not None:
            self._reshare(replica_id)

    def replicas(self) -> set[str]:
        """Every replica with own or peer sums."""
        return set(self.own) | set(self.peer)
