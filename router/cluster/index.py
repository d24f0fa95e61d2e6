"""The locality index: block hash -> the replicas believed to hold it.

Pure in-memory state fed by whoever reads the replicas' events (the Redis subscriber in
the live router, the simulator's event pump). No I/O here.

Layout. ``_holders`` maps a block hash to ``{replica id: entry}``, one entry per (block,
replica); each replica's ``ReplicaHoldings.blocks`` maps its hashes to the same entries.
``prefix_matches`` walks a request's chained hashes through ``_holders`` and narrows the
candidate set as it goes, so its cost is the sum of the matched lengths of the replicas
that hold a prefix, whatever the fleet's size.

Invariants:
    * ``e in _holders[h].values()`` iff ``e is holdings(r).blocks[h]`` for exactly one r;
      no hash maps to an empty dict.
    * An entry's ``parent`` is the entry of its parent block on the same replica if that
      block was indexed there when the child was stored (else None: a first block, or a
      parent unknown to the index); once the parent leaves first (a replica may evict a
      parent before its child) it is a dead entry (``children == -1``) that nothing
      counts. ``children`` counts the live entries whose parent it is; a *leaf* has 0.
    * Trimming removes leaves only, least recently used first (ties: the one pushed
      last, so an old sender's chain, stored root first without parents, still loses its
      tail first). An entry's ``tick`` is the index's clock at its last store, at the
      last match that ended on it, or (taken when it becomes a leaf) at the last use of
      a child: so a block is never less recent than its used descendants, while a match
      touches one entry per replica, not the whole prefix. Removing a leaf can make its
      parent a leaf. Dropping a root would zero every descendant's match, so a chain
      shrinks from its tail.
    * ``applied_seq[r]`` is the seq of the last event batch applied for replica r in its
      current epoch; a batch with another epoch or a seq gap marks r as needing resync.
    * A replica never holds more than ``max_blocks_per_replica`` entries, so memory is
      bounded even if a remove event is lost; nor more than its ``capacity`` (the KV
      blocks its signed heartbeat announces, 0 = unknown): a summary or batch that would
      leave more is an impossible claim; the index trims it, marks the replica for
      resync and records ``fault = "over_capacity"``.
    * ``fault`` says why the last failed apply marked a resync: "gap", "epoch" or
      "over_capacity" (the subscriber counts it; a gap or impossible claim is resynced
      from the replica itself).
    * A replica's leaf heap is rebuilt from its live leaves whenever a push leaves it
      above ``2 * len(blocks) + 64`` items (stale items are otherwise dropped lazily when
      popped), so it stays proportional to the entries.

Host tier. A replica with a host-memory tier also publishes which hashes it holds there
(``KVEventBatch.host_stored`` / ``host_removed``, ``CacheSummary.host_block_hashes``).
They live apart from the GPU entries, in ``ReplicaHoldings.host`` (insertion-ordered; a
set, no chains: a host block is only ever used in the run that continues a GPU match
through both tiers, read by ``tier_run``: after the GPU prefix, blocks on the host or,
past the first, on the GPU, as the replica's store matches them). A replica's host
hashes follow the same epoch/seq gating as its GPU ones (one batch carries both), are
dropped with them (clear, summary, replica drop), and are bounded by
``max_blocks_per_replica`` and by the host capacity its heartbeat announces
(``set_host_capacity``), oldest first.

Hybrid models. A vLLM backend serving a model with sliding-window (or Mamba) KV cache
groups indexes as its blocks those every full-attention group holds; each window group
adds ``(k, held)`` (``set_windows``: its hashes, kept up to date by its translator): a
prefix of n blocks is a hit on it only if every window holds blocks ``n - k .. n - 1``
(all of them when n < k), so each match of such a replica is cut back to the longest n
that passes (``_window_limit``), and ``prefix_match_groups`` walks it on its own.

Without parents (``parents=None``: a batch or summary from a sender older than
``KVEventBatch.stored_parents`` / ``CacheSummary.parents``) every block is indexed as a
root and trimming falls back to the tie rule above: within one batch or summary the block
listed last goes first. Replicas list a chain root first (a store caches a prompt's
blocks in order), so even then a chain mostly loses its tail first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_tier import tier_run
from unicache.router.routing.base import NO_RUN, LocalityView, TierRun

_HEAP_SLACK = 64


@dataclass(slots=True, eq=False)
class IndexEntry:
    """One (block, replica) entry. ``children == -1`` once it left the index."""

    block_hash: BlockHash
    parent: IndexEntry | None
    children: int
    tick: int


@dataclass(slots=True)
class ReplicaHoldings:
    """One replica's entries plus its stream position and bounds."""

    blocks: dict[BlockHash, IndexEntry] = field(default_factory=dict)
    leaves: list[tuple[int, int, BlockHash]] = field(default_factory=list)  # (tick, -order, hash)
    epoch: int = -1
    applied_seq: int = -1
    needs_resync: bool = True
    capacity: int = 0
    fault: str = ""
    host: dict[BlockHash, None] = field(default_factory=dict)  # host-tier hashes, oldest first
    host_capacity: int = 0
    windows: tuple[tuple[int, Collection[BlockHash]], ...] = ()  # a hybrid model's window groups


class LocalityIndex(LocalityView):
    """Block hash -> replicas, with per-replica leaf-first LRU bounds and gap detection.

    Args:
        max_blocks_per_replica: bound on each replica's entries (default 2,000,000;
            ``bench.fleet_scale`` measures the bytes per entry).
    """

    def __init__(self, max_blocks_per_replica: int = 2_000_000):
        if max_blocks_per_replica <= 0:
            raise ValueError("max_blocks_per_replica must be positive")
        self.max_blocks = max_blocks_per_replica
        self._replicas: dict[str, ReplicaHoldings] = {}
        self._holders: dict[BlockHash, dict[str, IndexEntry]] = {}
        self._host_holders: dict[BlockHash, set[str]] = {}  # host-tier hash -> replicas
        self._tick = 0
        self._order = 0
        # called with (replica id, hashes) for the blocks each batch or summary stores and
        # removes (the router's pending blocks: router/cluster/pending.py); None: nobody
        self.on_stored: Callable[[str, Sequence[BlockHash]], None] | None = None
        self.on_removed: Callable[[str, Sequence[BlockHash]], None] | None = None
        self._windowed: set[str] = set()  # replicas with window groups (hybrid models)

    # ------------------------------------------------------------------ reading
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def holdings(self, replica_id: str) -> ReplicaHoldings:
        h = self._replicas.get(replica_id)
        if h is None:
            h = self._replicas[replica_id] = ReplicaHoldings()
        return h

    def holders(self, block_hash: BlockHash) -> set[str]:
        """The replicas that hold ``block_hash`` (a copy)."""
        return set(self._holders.get(block_hash, ()))

    def num_blocks(self, replica_id: str) -> int:
        h = self._replicas.get(replica_id)
        return len(h.blocks) if h else 0

    def num_entries(self) -> int:
        """(block, replica) entries in the index."""
        return sum(len(h.blocks) for h in self._replicas.values())

    def num_hashes(self) -> int:
        """Distinct block hashes in the index."""
        return len(self._holders)

    def needs_resync(self, replica_id: str) -> bool:
        h = self._replicas.get(replica_id)
        return h is None or h.needs_resync

    def is_stale(self, replica_id: str) -> bool:
        return self.needs_resync(replica_id)

    def match(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Leading ``block_hashes`` the replica holds; refreshes the deepest (a use)."""
        h = self._replicas.get(replica_id)
        if h is None:
            return 0
        self._tick += 1
        n = _walk(h.blocks, block_hashes, self._tick)
        return _window_limit(h.windows, block_hashes, n) if h.windows and n else n

    def held_prefix(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Leading ``block_hashes`` the replica's entries hold, before any window cut and
        without refreshing them (what a dispatch to it adds nothing pending for)."""
        h = self._replicas.get(replica_id)
        if h is None:
            return 0
        blocks, n = h.blocks, 0
        for bh in block_hashes:
            if bh not in blocks:
                break
            n += 1
        return n

    def tier_run(self, replica_id: str, block_hashes: Sequence[BlockHash], start: int) -> TierRun:
        """The run of ``block_hashes[start:]`` that the replica's host tier and GPU
        entries hold together, its first block on the host (``LocalityView.tier_run``)."""
        h = self._replicas.get(replica_id)
        if h is None or not h.host:
            return NO_RUN
        return _tier_walk(h, block_hashes, start)

    def tier_runs(self, block_hashes: Sequence[BlockHash], gpu_matches: dict[str, int],
                  groups: Sequence[tuple[int, Collection[str]]] = ()) -> dict[str, TierRun]:
        """``tier_run(r, block_hashes, m_r)`` for every replica r whose host tier holds
        block ``m_r`` (its GPU match: from ``gpu_matches``, else the length of the group
        of ``prefix_match_groups`` it is in, else 0); the others have none. Visits only
        those replicas (host-tier hash -> replicas; a group's by one set intersection)."""
        host_holders = self._host_holders
        n = len(block_hashes)
        if not host_holders or not n:
            return {}
        replicas = self._replicas
        out: dict[str, TierRun] = {}
        for rid in host_holders.get(block_hashes[0], ()):
            if rid not in gpu_matches and not any(rid in ids for _, ids in groups):
                out[rid] = _tier_walk(replicas[rid], block_hashes, 0)
        for rid, m in gpu_matches.items():
            if m < n:
                held = host_holders.get(block_hashes[m])
                if held is not None and rid in held:
                    out[rid] = _tier_walk(replicas[rid], block_hashes, m)
        for m, ids in groups:
            held = host_holders.get(block_hashes[m]) if m < n else None
            if held:
                for rid in held.intersection(ids):
                    out[rid] = _tier_walk(replicas[rid], block_hashes, m)
        return out

    def num_host_blocks(self, replica_id: str) -> int:
        h = self._replicas.get(replica_id)
        return len(h.host) if h else 0

    def prefix_matches(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Every replica holding at least the first block, with how many leading blocks
        it holds; refreshes each one's deepest matched entry. Cost: one dict lookup per
        matched block of each replica holding the first block, never a look at a replica
        that matches nothing."""
        if not block_hashes:
            return {}
        level = self._holders.get(block_hashes[0])
        if not level:
            return {}
        self._tick += 1
        tick = self._tick
        replicas = self._replicas
        out = {rid: _walk(replicas[rid].blocks, block_hashes, tick) for rid in level}
        if self._windowed:
            self._limit_windowed(out, block_hashes)
        return out

    def prefix_match_groups(self, block_hashes: Sequence[BlockHash],
                            wide: int) -> tuple[dict[str, int], list[tuple[int, set[str]]]]:
        """``LocalityView.prefix_match_groups``: the prefix a whole fleet shares (a system
        prompt every replica holds) costs set intersections of the holders' ids at C
        speed, one per block of it, instead of a Python step per replica and block; the
        matched entries' ticks are refreshed as ``prefix_matches`` refreshes them."""
        if not block_hashes:
            return {}, []
        holders = self._holders
        level = holders.get(block_hashes[0])
        if not level:
            return {}, []
        self._tick += 1
        tick = self._tick
        replicas = self._replicas
        if len(level) <= wide or (self._windowed and not self._windowed.isdisjoint(level)):
            out = {rid: _walk(replicas[rid].blocks, block_hashes, tick) for rid in level}
            if self._windowed:
                self._limit_windowed(out, block_hashes)
            return out, []
        n = len(block_hashes)
        groups: list[tuple[int, set[str]]] = []
        current = level.keys()  # the replicas holding blocks [0, i); ``level``: their block i - 1
        i = 1
        while len(current) > wide:
            nxt = holders.get(block_hashes[i]) if i < n else None
            still = current & nxt.keys() if nxt else set()
            stopped = current - still
            if stopped:
                for rid in stopped:
                    level[rid].tick = tick  # the deepest entry each one matched
                groups.append((i, stopped))
            if not still:
                return {}, groups
            current, level, i = still, nxt, i + 1
        deep: dict[str, int] = {}
        for rid in current:
            blocks = replicas[rid].blocks
            k = i
            while k < n and block_hashes[k] in blocks:
                k += 1
            blocks[block_hashes[k - 1]].tick = tick
            deep[rid] = k
        return deep, groups

    def _limit_windowed(self, matches: dict[str, int], block_hashes: Sequence[BlockHash]) -> None:
        replicas = self._replicas
        for rid in self._windowed.intersection(matches):
            if matches[rid]:
                matches[rid] = _window_limit(replicas[rid].windows, block_hashes, matches[rid])

    # ------------------------------------------------------------------ writing
    def set_windows(self, replica_id: str, windows: Sequence[tuple[int, Collection[BlockHash]]]) -> None:
        """The replica's window groups: ``(k, held)`` each (see the module docstring);
        ``held`` is read at every match, its owner keeps it current. Empty: none."""
        self.holdings(replica_id).windows = tuple(windows)
        if windows:
            self._windowed.add(replica_id)
        else:
            self._windowed.discard(replica_id)

    def set_capacity(self, replica_id: str, capacity_blocks: int) -> None:
        """The replica's KV capacity in blocks (from its heartbeat); 0 leaves it unknown."""
        self.holdings(replica_id).capacity = capacity_blocks

    def set_host_capacity(self, replica_id: str, capacity_blocks: int) -> None:
        """The replica's host-tier capacity in blocks (from its heartbeat; 0: unknown)."""
        self.holdings(replica_id).host_capacity = capacity_blocks

    def apply_summary(
        self,
        replica_id: str,
        epoch: int,
        seq: int,
        block_hashes: Iterable[BlockHash],
        parents: Sequence[BlockHash | None] | None = None,
        host_hashes: Iterable[BlockHash] = (),
    ) -> bool:
        """Replace a replica's holdings by a full summary taken at (epoch, seq).

        ``parents[i]`` is the parent hash of ``block_hashes[i]`` (None: a first block);
        ``parents=None``: unknown (an old sender). ``host_hashes``: its host tier's.
        Returns False (trimmed to capacity, resync marked) when it claims more blocks
        than the replica's capacity."""
        h = self.holdings(replica_id)
        self._clear(replica_id, h)
        h.epoch, h.applied_seq, h.needs_resync = epoch, seq, False
        self._store(replica_id, h, block_hashes, parents)
        self._host_update(replica_id, h, (), host_hashes)
        return self._trim(h, replica_id)

    def apply_events(
        self,
        replica_id: str,
        epoch: int,
        seq: int,
        stored: Sequence[BlockHash],
        removed: Iterable[BlockHash],
        cleared: bool = False,
        parents: Sequence[BlockHash | None] | None = None,
        host_stored: Iterable[BlockHash] = (),
        host_removed: Iterable[BlockHash] = (),
    ) -> bool:
        """Apply one event batch: ``cleared``, then ``removed``, then ``stored`` (with
        ``parents`` as in ``apply_summary``), and the same for the host tier. Returns False (and marks resync) on a gap
        or epoch change, or when the result exceeds the capacity. Batches at or below the
        applied seq are duplicates and ignored (returns True)."""
        h = self.holdings(replica_id)
        if epoch != h.epoch or h.needs_resync:
            h.needs_resync, h.fault = True, "epoch"
            return False
        if seq <= h.applied_seq:
            return True
        if seq != h.applied_seq + 1:
            h.needs_resync, h.fault = True, "gap"
            return False
        if cleared:
            self._clear(replica_id, h)
        self._remove(replica_id, h, removed)
        self._store(replica_id, h, stored, parents)
        self._host_update(replica_id, h, host_removed, host_stored)
        h.applied_seq = seq
        return self._trim(h, replica_id)

    def apply_events_unchecked(
        self,
        replica_id: str,
        stored: Sequence[BlockHash],
        removed: Iterable[BlockHash],
        parents: Sequence[BlockHash | None] | None = None,
        cleared: bool = False,
        host_stored: Iterable[BlockHash] = (),
        host_removed: Iterable[BlockHash] = (),
    ) -> None:
        """Apply events from a lossless in-process source (the simulator)."""
        h = self.holdings(replica_id)
        h.needs_resync = False
        if cleared:
            self._clear(replica_id, h)
        self._remove(replica_id, h, removed)
        self._store(replica_id, h, stored, parents)
        self._host_update(replica_id, h, host_removed, host_stored)
        self._trim(h, replica_id)

    def mark_resync(self, replica_id: str) -> None:
        self.holdings(replica_id).needs_resync = True

    def drop_replica(self, replica_id: str) -> None:
        """Forget the replica: it leaves every block's holder set."""
        h = self._replicas.pop(replica_id, None)
        self._windowed.discard(replica_id)
        if h is not None:
            self._clear(replica_id, h)

    # ------------------------------------------------------------------ internals
    def _clear(self, rid: str, h: ReplicaHoldings) -> None:
        holders = self._holders
        for bh, e in h.blocks.items():
            e.children, e.parent = -1, None
            level = holders[bh]
            del level[rid]
            if not level:
                del holders[bh]
        h.blocks = {}
        h.leaves = []
        host_holders = self._host_holders
        for bh in h.host:
            self._unhost(host_holders, rid, bh)
        h.host = {}

    def _host_update(self, rid: str, h: ReplicaHoldings, removed: Iterable[BlockHash],
                     stored: Iterable[BlockHash]) -> None:
        """Host-tier removes then stores; then the oldest go past the bound."""
        host, host_holders = h.host, self._host_holders
        for bh in removed:
            if bh in host:
                del host[bh]
                self._unhost(host_holders, rid, bh)
        for bh in stored:
            if bh in host:
                del host[bh]  # a re-store is the newest
            else:
                held = host_holders.get(bh)
                if held is None:
                    host_holders[bh] = {rid}
                else:
                    held.add(rid)
            host[bh] = None
        bound = min(self.max_blocks, h.host_capacity) if h.host_capacity else self.max_blocks
        excess = len(host) - bound
        if excess > 0:
            for bh in list(itertools.islice(host, excess)):
                del host[bh]
                self._unhost(host_holders, rid, bh)

    @staticmethod
    def _unhost(host_holders: dict[BlockHash, set[str]], rid: str, bh: BlockHash) -> None:
        held = host_holders[bh]
        held.discard(rid)
        if not held:
            del host_holders[bh]

    def _remove(self, rid: str, h: ReplicaHoldings, removed: Iterable[BlockHash]) -> None:
        if self.on_removed is not None:
            removed = removed if isinstance(removed, Sequence) else list(removed)
            self.on_removed(rid, removed)
        blocks = h.blocks
        for bh in removed:
            e = blocks.get(bh)
            if e is not None:
                self._drop(rid, h, e)

    def _drop(self, rid: str, h: ReplicaHoldings, e: IndexEntry) -> None:
        bh = e.block_hash
        del h.blocks[bh]
        level = self._holders[bh]
        del level[rid]
        if not level:
            del self._holders[bh]
        p = e.parent
        e.children, e.parent = -1, None
        if p is not None and p.children > 0:
            p.children -= 1
            if p.children == 0:
                if e.tick > p.tick:
                    p.tick = e.tick  # a use of the child was a use of its prefix
                self._push(h, p)

    def _push(self, h: ReplicaHoldings, e: IndexEntry) -> None:
        self._order += 1
        heapq.heappush(h.leaves, (e.tick, -self._order, e.block_hash))
        if len(h.leaves) > 2 * len(h.blocks) + _HEAP_SLACK:
            self._compact(h)

    def _store(
        self,
        rid: str,
        h: ReplicaHoldings,
        stored: Iterable[BlockHash],
        parents: Sequence[BlockHash | None] | None,
    ) -> None:
        stored = stored if isinstance(stored, Sequence) else list(stored)
        if parents is not None and len(parents) != len(stored):
            raise ValueError(f"{len(parents)} parents for {len(stored)} stored blocks")
        if self.on_stored is not None and stored:
            self.on_stored(rid, stored)
        if not stored:
            return
        self._tick += 1
        tick = self._tick
        blocks = h.blocks
        holders = self._holders
        new: list[tuple[IndexEntry, BlockHash | None]] = []
        for i, bh in enumerate(stored):
            e = blocks.get(bh)
            if e is not None:
                e.tick = tick  # stored again: a use
                continue
            e = blocks[bh] = IndexEntry(bh, None, 0, tick)
            level = holders.get(bh)
            if level is None:
                holders[bh] = {rid: e}
            else:
                level[rid] = e
            new.append((e, parents[i] if parents is not None else None))
        # NOTE: link after inserting the whole batch: a batch is a set, and a parent
        # stored in it may come after its child.
        for e, ph in new:
            if ph:
                p = blocks.get(ph)
                if p is not None and p is not e:
                    e.parent = p
                    p.children += 1
        for e, _ph in new:
            if e.children == 0:
                self._push(h, e)

    def _compact(self, h: ReplicaHoldings) -> None:
        """Rebuild the leaf heap from the live leaves (drops every stale item)."""
        items = []
        for e in h.blocks.values():
            if e.children == 0:
                self._order += 1
                items.append((e.tick, -self._order, e.block_hash))
        heapq.heapify(items)
        h.leaves = items

    def _pop_leaf(self, h: ReplicaHoldings) -> IndexEntry:
        """The least recently used leaf (see the module invariants)."""
        blocks = h.blocks
        while True:
            if not h.leaves:
                self._compact(h)
                if not h.leaves:
                    # NOTE: only a parent cycle (a corrupt sender) leaves entries and no
                    # leaf; the bound still holds: drop the oldest-inserted entry.
                    return next(iter(blocks.values()))
            tick, _neg, bh = heapq.heappop(h.leaves)
            e = blocks.get(bh)
            if e is None or e.children != 0:
                continue  # gone, or no longer a leaf
            if e.tick != tick:
                self._push(h, e)  # used since it was pushed: requeue at its last use
                continue
            return e

    def _trim(self, h: ReplicaHoldings, rid: str) -> bool:
        """Drop least recently used leaves down to both bounds. Returns False when the
        capacity bound had to cut (an impossible claim)."""
        while len(h.blocks) > self.max_blocks:
            self._drop(rid, h, self._pop_leaf(h))
        if h.capacity and len(h.blocks) > h.capacity:
            while len(h.blocks) > h.capacity:
                self._drop(rid, h, self._pop_leaf(h))
            h.needs_resync, h.fault = True, "over_capacity"
            return False
        return True


def _walk(blocks: dict[BlockHash, IndexEntry], block_hashes: Sequence[BlockHash], tick: int) -> int:
    """Leading ``block_hashes`` in ``blocks``; the deepest one found gets ``tick``."""
    n = 0
    for bh in block_hashes:
        if bh not in blocks:
            break
        n += 1
    if n:
        blocks[block_hashes[n - 1]].tick = tick
    return n


def _window_limit(windows: Sequence[tuple[int, Collection[BlockHash]]], block_hashes: Sequence[BlockHash], n: int) -> int:
    """The longest m <= n such that every window ``(k, held)`` holds ``block_hashes[m-k:m]``
    (``[0:m]`` when m < k): vLLM's sliding-window hit rule over a full-attention match n."""
    while n > 0:
        for k, held in windows:
            lo = n - k if n > k else 0
            i = n - 1
            while i >= lo and block_hashes[i] in held:
                i -= 1
            if i >= lo:  # block i is missing: no m in (i, i + k] passes, and n <= i + k
                n = i
                break
        else:
            return n
    return 0


def _tier_walk(h: ReplicaHoldings, block_hashes: Sequence[BlockHash], start: int) -> TierRun:
    """``unicache.contract.kv_tier.tier_run`` through the index's copy of a replica's holdings."""
    n, gpu_at = tier_run(block_hashes, start, len(block_hashes), h.host, h.blocks)
    return TierRun(n, tuple(gpu_at)) if n else NO_RUN
