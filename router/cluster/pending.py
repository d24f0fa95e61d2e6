"""Blocks the router just sent: a routed request's prompt hashes, pending on its backend
from dispatch until the backend's events confirm them, an event removes them, or they
age out.

The locality index learns a backend's blocks from its events (Redis or vLLM's ZMQ), which
come after the prefill, and not at all while Redis restarts. A chat's next turn sent
right after this one would find nothing of its prefix on its backend and go by load
alone. So at dispatch the router records the request's hashes as pending there
(``add``), and the view policies read (``PendingView``) counts them past the index's own
match: a replica's match is extended over the hashes pending on it, in order.

A stored event for a pending hash confirms it (the index's entry replaces it: ``confirm``),
a removed event drops it (``drop``), and one not confirmed within ``ttl_s`` ages out, so a
request that failed, or a block the backend never cached, stops counting. Pending blocks
live apart from the index and outlive its resyncs (a Redis restart empties the index
until summaries return); they go with the replica (``drop_replica``).

Invariants:
    * At most ``max_per_replica`` hashes pending per replica (oldest dropped first);
      each ``add`` also drops every replica's expired ones (``_deadlines`` holds each
      add's deadline in time order: O(1) amortised).
    * ``_holders[h]`` is exactly the set of replicas with ``h`` pending (no empty set).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence

from unicache.contract.block_hash import BlockHash
from unicache.router.routing.base import LocalityView, TierRun


class PendingBlocks:
    """Per replica, the hashes routed there and not yet confirmed (module docstring).

    Args:
        ttl_s: a pending hash not confirmed within this many seconds stops counting
            (default 30).
        max_per_replica: bound on the hashes pending per replica (default 65,536).
        clock: seconds (default ``time.monotonic``).
        held: how many leading hashes of a prompt a replica's index already holds
            (``LocalityIndex.held_prefix``; None: none known). Those are not pending: no
            event will confirm them (vLLM reports a reused block once, when it cached it),
            and counting them past the index's match would undo what bounds that match
            (a hybrid model's window groups).
    """

    def __init__(self, ttl_s: float = 30.0, max_per_replica: int = 65_536,
                 clock: Callable[[], float] = time.monotonic,
                 held: Callable[[str, Sequence[BlockHash]], int] | None = None):
        if ttl_s <= 0 or max_per_replica <= 0:
            raise ValueError("ttl_s and max_per_replica must be positive")
        self.ttl_s = ttl_s
        self.max_per_replica = max_per_replica
        self.clock = clock
        self.held = held
        self._by_replica: dict[str, OrderedDict[BlockHash, float]] = {}
        self._holders: dict[BlockHash, set[str]] = {}
        self._deadlines: deque[tuple[float, str, BlockHash]] = deque()  # every add, oldest first
        self._size = 0  # hashes pending, all replicas

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return bool(self._holders)

    def add(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        """``hashes`` were just routed to ``replica_id`` (the leading ones its index holds
        are not pending)."""
        if hashes and self.held is not None:
            hashes = hashes[self.held(replica_id, hashes):]
        if not hashes:
            return
        now = self.clock()
        od = self._by_replica.get(replica_id)
        if od is None:
            od = self._by_replica[replica_id] = OrderedDict()
        holders = self._holders
        expiry = now + self.ttl_s
        deadlines = self._deadlines
        for h in hashes:
            if h in od:
                od.move_to_end(h)
            else:
                holders.setdefault(h, set()).add(replica_id)
                self._size += 1
            od[h] = expiry
            deadlines.append((expiry, replica_id, h))
        while len(od) > self.max_per_replica:
            self._unhold(od.popitem(last=False)[0], replica_id)
        # the expired ones, every replica's (an entry re-added since has a later deadline)
        while deadlines and deadlines[0][0] <= now:
            _, rid, h = deadlines.popleft()
            q = self._by_replica.get(rid)
            if q is not None and q.get(h, now + 1.0) <= now:
                del q[h]
                self._unhold(h, rid)
        while len(deadlines) > 2 * self._size + 64:  # re-adds leave stale deadlines: keep them proportional
            self._deadlines = deadlines = deque((t, rid, h) for t, rid, h in deadlines
                                                if self._by_replica.get(rid, {}).get(h) == t)
            break

    def _unhold(self, h: BlockHash, replica_id: str) -> None:
        """``h`` just left ``replica_id``'s pending hashes."""
        self._size -= 1
        s = self._holders.get(h)
        if s is not None:
            s.discard(replica_id)
            if not s:
                del self._holders[h]

    def confirm(self, replica_id: str, hashes: Iterable[BlockHash]) -> None:
        """The replica's events stored ``hashes`` (the index holds them now) or removed
        them: either way they are no longer pending."""
        od = self._by_replica.get(replica_id)
        if not od:
            return
        for h in hashes:
            if od.pop(h, None) is not None:
                self._unhold(h, replica_id)

    drop = confirm

    def drop_replica(self, replica_id: str) -> None:
        od = self._by_replica.pop(replica_id, None)
        for h in od or ():
            self._unhold(h, replica_id)

    def run(self, replica_id: str, hashes: Sequence[BlockHash], start: int, now: float) -> int:
        """The end of the run of ``hashes[start:]`` pending (unexpired) on the replica."""
        od = self._by_replica.get(replica_id)
        if not od:
            return start
        k, n = start, len(hashes)
        while k < n:
            t = od.get(hashes[k])
            if t is None or t <= now:
                break
            k += 1
        return k

    def extend(self, matches: dict[str, int], hashes: Sequence[BlockHash]) -> dict[str, int]:
        """``matches`` (an index's ``prefix_matches``) with each replica's match extended
        over the hashes pending on it; a replica with the first hash pending joins. The
        same dict when nothing is pending for this prompt."""
        if not self._by_replica or not hashes:
            return matches
        now = self.clock()
        first = self._holders.get(hashes[0])
        out = None
        for rid, m in matches.items():
            k = self.run(rid, hashes, m, now)
            if k > m:
                if out is None:
                    out = dict(matches)
                out[rid] = k
        if first:
            for rid in first:
                if rid not in matches:
                    k = self.run(rid, hashes, 0, now)
                    if k:
                        if out is None:
                            out = dict(matches)
                        out[rid] = k
        return matches if out is None else out


class PendingView(LocalityView):
    """An index view (``base``) with the blocks pending on each replica counted past its
    match (``PendingBlocks.extend``); everything else is the base's."""

    __slots__ = ("base", "pending")

    def __init__(self, base: LocalityView, pending: PendingBlocks):
        self.base = base
        self.pending = pending

    def match(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        m = self.base.match(replica_id, block_hashes)
        return self.pending.run(replica_id, block_hashes, m, self.pending.clock())

    def prefix_matches(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self.pending.extend(self.base.prefix_matches(block_hashes), block_hashes)

    def prefix_match_groups(self, block_hashes: Sequence[BlockHash], wide: int):
        deep, groups = self.base.prefix_match_groups(block_hashes, wide)
        if not groups:
            return self.pending.extend(deep, block_hashes), groups
        # a replica with pending blocks past its group's length leaves the group for ``deep``
        flat = dict(deep)
        for length, ids in groups:
            for rid in ids:
                flat[rid] = length
        ext = self.pending.extend(flat, block_hashes)
        if ext is flat:
            return deep, groups
        deep = dict(deep)
        moved = {rid for rid, k in ext.items() if k != flat.get(rid, -1) or rid in deep}
        for rid in moved:
            deep[rid] = ext[rid]
        groups = [(length, ids - moved if isinstance(ids, set) else frozenset(ids) - moved) for length, ids in groups]
        return deep, [(length, ids) for length, ids in groups if ids]

    def tier_run(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int) -> TierRun:
        return self.base.tier_run(replica_id, block_hashes, start)

    def tier_runs(self, block_hashes: Sequence[BlockHash], gpu_matches: dict[str, int],
                  groups: Sequence[tuple[int, Collection[str]]] = ()) -> dict[str, TierRun]:
        return self.base.tier_runs(block_hashes, gpu_matches, groups)

    def is_stale(self, replica_id: str) -> bool:
        return self.base.is_stale(replica_id)

    def __getattr__(self, name: str):
        # what a policy or test reads of the index beyond the view (num_blocks, ...)
        return getattr(self.base, name)
