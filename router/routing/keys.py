"""Keys and orders the router and every routing policy share: the session key, the consistent-hash ring, the load order.

They live apart from any one policy so that the router core, ``cache_aware`` and the
baselines import them from here rather than from one another.

Invariants:
    * ``ring_hash`` is xxh64 with seed 0, never ``hash()``: two router processes with the
      same replica set place every key on the same point.
    * ``session_key`` is per tenant: equal session ids of two tenants never collide.
    * ``load_key`` is a total order (replica id last), so a choice by load is
      deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import xxhash

from unicache.router.routing.base import ReplicaLoad


def ring_hash(key: str) -> int:
    """Position of ``key`` on the 64-bit ring."""
    return xxhash.xxh64_intdigest(key.encode("utf-8"))


def session_key(tenant: str, session_id: str) -> str:
    """Sessions are per tenant: equal session ids of two tenants are different sessions."""
    return f"{tenant}\x1f{session_id}"


class HashRing:
    """A consistent-hash ring with virtual nodes.

    Membership changes only mark the ring stale; the next ``owner`` (or ``points``)
    rebuilds it once from each member's cached points. A router that learns 1,024
    replicas one heartbeat at a time thus sorts the ring once, not once per join (which
    rehashed 84M points and took minutes).

    Args:
        virtual_nodes: points per replica (default 160; more points, smoother shares).
    """

    def __init__(self, virtual_nodes: int = 160):
        if virtual_nodes <= 0:
            raise ValueError("virtual_nodes must be positive")
        self.virtual_nodes = virtual_nodes
        self._members: set[str] = set()
        self._cached: dict[str, list[int]] = {}  # member -> its points (members only)
        self._points: list[int] = []
        self._owners: list[str] = []
        self._stale = False

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def set_members(self, replica_ids: Iterable[str]) -> None:
        members = set(replica_ids)
        if members != self._members:
            self._members = members
            self._stale = True

    def add(self, replica_id: str) -> None:
        if replica_id not in self._members:
            self._members.add(replica_id)
            self._stale = True

    def remove(self, replica_id: str) -> None:
        if replica_id in self._members:
            self._members.discard(replica_id)
            self._stale = True

    def points(self) -> list[tuple[int, str]]:
        """The ring: (point, owner) in ring order."""
        self._fresh()
        return list(zip(self._points, self._owners))

    def _fresh(self) -> None:
        if not self._stale:
            return
        cached, vn = self._cached, self.virtual_nodes
        for r in list(cached):
            if r not in self._members:
                del cached[r]
        for r in self._members:
            if r not in cached:
                cached[r] = [ring_hash(f"{r}#{i}") for i in range(vn)]
        # NOTE: ties between equal points (astronomically rare) break by replica id, so
        # the ring is a pure function of the member set.
        pts = sorted((p, r) for r in self._members for p in cached[r])
        self._points = [p for p, _ in pts]
        self._owners = [r for _, r in pts]
        self._stale = False

    def owner(self, key: str, live: set[str] | frozenset[str] | None = None) -> str | None:
        """First owner clockwise of ``key`` that is in ``live`` (any member when None)."""
        self._fresh()
        n = len(self._points)
        if n == 0:
            return None
        start = bisect.bisect_left(self._points, ring_hash(key))
        for step in range(n):
            r = self._owners[(start + step) % n]
            if live is None or r in live:
                return r
        return None


def load_key(load: ReplicaLoad) -> tuple[int, int, str]:
    """Sort key of a replica by load; smaller is less loaded."""
    return (load.outstanding, load.queued_prefill_tokens, load.replica_id)


def pick_least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The least loaded replica of a non-empty sequence (ties broken by ``load_key``)."""
    return min(replicas, key=load_key)
