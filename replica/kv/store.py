"""The paged KV store: block tables, reference counts, prefix cache, copy-on-write.

One code path for the engine (with ``TorchKVStorage``) and the simulator (metadata only).
The store never does I/O: cache events queue up until ``take_events`` (unless built with
``collect_events=False``, for a caller that has no subscriber).

With a host tier (``host=HostTier(...)``) a GPU victim is demoted to it instead of dropped,
and ``allocate`` promotes the host blocks a prefix match runs into. With
``record_transfers`` those copies queue up (``unicache.replica.kv.transfers``) until
``flush_transfers`` hands them, batched, to the storage; the engine flushes before every
forward pass, and the store itself before a copy-on-write (which may reuse a block whose
demotion is still queued).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.contract.kv_tier import Tier, tier_run
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.kv.block import FreeBlockQueue, KVBlock
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.storage import KVStorage, MetadataOnlyStorage
from unicache.replica.kv.transfers import Transfer, transfer_runs


class OutOfBlocks(RuntimeError):
    """Not enough free blocks; the store is unchanged."""


@dataclass(slots=True)
class RequestBlocks:
    """A request's block table and what is known about it.

    ``hashes[i]`` is the hash of block i when the block is full and its content known;
    ``num_cached`` leading blocks have been offered to the prefix cache.
    """

    request_id: str
    cls: RequestClass
    blocks: list[KVBlock]
    num_tokens: int
    num_prompt_blocks: int
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached: int = 0


@dataclass(slots=True, frozen=True)
class Allocation:
    """What ``allocate`` hands back: the block table and how much of the prompt hit.

    ``num_hit_blocks`` counts every leading block the request need not compute: GPU hits
    and ``num_host_hit_blocks`` promoted ones (their copies are queued transfers), which
    follow the GPU prefix and may alternate with GPU hits (``KVStore._tier_run``).
    """

    block_ids: tuple[int, ...]
    num_hit_blocks: int
    num_hit_tokens: int
    num_host_hit_blocks: int = 0


@dataclass(slots=True)
class CacheStats:
    """GPU-tier counters (the host tier's are ``HostTier.stats``).

    ``hit_blocks`` are GPU hits; ``evictions`` GPU victims, demoted or dropped."""

    query_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


class KVStore:
    """Fixed-size paged KV blocks with a prefix cache evicted by a plug-in policy.

    Invariants (``check_invariants`` asserts them; the property tests drive it):
        * every block is in exactly one of: a request's table (ref_cnt > 0), the uncached
          free queue (ref_cnt 0, no hash), the policy's candidates (ref_cnt 0, hash);
        * ``_cached[h].block_hash == h`` and every hashed block is in ``_cached``;
        * ref_cnt equals the number of request tables holding the block;
        * with a host tier, a hash is in the GPU cache or the host tier, never both.

    Args:
        collect_events: queue cache events for ``take_events`` (default). Off, nothing is
            queued and ``take_events`` returns ``[]``: for callers without a subscriber
            (the single-replica simulator), where building the event records cost as
            much as the eviction itself.
        host: the host-memory tier under the GPU pool (None: single tier).
        record_transfers: queue a ``Transfer`` per demotion and promotion for
            ``flush_transfers`` (an engine with host tensors: the storage must have
            ``run_transfers``); off, only the bookkeeping moves (the simulator).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: EvictionPolicy,
        storage: KVStorage | None = None,
        enable_prefix_caching: bool = True,
        collect_events: bool = True,
        host: HostTier | None = None,
        record_transfers: bool = False,
    ):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.storage = storage if storage is not None else MetadataOnlyStorage(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._requests: dict[str, RequestBlocks] = {}
        self._events: list[KVEvent] = []
        self.collect_events = collect_events
        self.stats = CacheStats()
        self.host = host
        self.record_transfers = record_transfers
        self._transfers: list[Transfer] = []

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: uncached free plus evictable cached."""
        return self._free.size + len(self.policy)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, block_hashes: list[BlockHash]) -> int:
        """Number of leading hashes present in the prefix cache. No side effects."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        cached = self._cached
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    def match_tiers(self, block_hashes: list[BlockHash]) -> tuple[int, int]:
        """``(gpu, host)``: of the longest run of leading hashes that the two tiers hold
        together (``_tier_run``), how many are in the GPU cache and how many in the host
        tier. No side effects."""
        gpu = self.match_prefix(block_hashes)
        if self.host is None or not self.enable_prefix_caching:
            return gpu, 0
        run, on_gpu = self._tier_run(block_hashes, gpu, len(block_hashes))
        return gpu + len(on_gpu), run - len(on_gpu)

    def _tier_run(self, block_hashes: list[BlockHash], start: int, stop: int) -> tuple[int, list[int]]:
        """``unicache.contract.kv_tier.tier_run`` through this store's host tier and GPU cache."""
        assert self.host is not None
        return tier_run(block_hashes, start, stop, self.host, self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the GPU prefix cache (for full summaries)."""
        return list(self._cached)

    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """(hash, parent hash or None for a first block) of every GPU-cached block, in
        ``cached_hashes`` order (what a summary publishes, so a router knows the chains)."""
        return [(h, b.parent_hash) for h, b in self._cached.items()]

    def host_hashes(self) -> list[BlockHash]:
        """Every hash in the host tier (empty without one)."""
        return self.host.hashes() if self.host is not None else []

    def request(self, request_id: str) -> RequestBlocks:
        return self._requests[request_id]

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._requests[request_id].blocks]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ------------------------------------------------------------- allocation
    def can_allocate(self, block_hashes: list[BlockHash], num_tokens: int) -> bool:
        shared, needed = self._plan(block_hashes, self.blocks_for_tokens(num_tokens))[:2]
        return self._new_blocks_available(shared, needed)

    def _plan(self, block_hashes: list[BlockHash], total: int) -> tuple[list[BlockHash], int, int, list[int]]:
        """What ``allocate`` of ``total`` blocks would do: ``(shared, needed, run,
        on_gpu)``, the hashes of the GPU blocks it shares, how many new blocks it takes,
        and the tier run past the GPU prefix (``_tier_run``)."""
        hits = min(self.match_prefix(block_hashes), total)
        run, on_gpu = 0, []
        if self.host is not None and hits < total and self.enable_prefix_caching:
            run, on_gpu = self._tier_run(block_hashes, hits, total)
        shared = block_hashes[:hits]
        if on_gpu:
            shared = shared + [block_hashes[i] for i in on_gpu]
        return shared, total - len(shared), run, on_gpu

    def _new_blocks_available(self, hit_hashes: list[BlockHash], needed: int) -> bool:
        # Hit blocks that are eviction candidates stop being free once acquired.
        evictable_hits = sum(1 for h in hit_hashes if self._cached[h].ref_cnt == 0)
        return needed <= self.num_free_blocks - evictable_hits

    def allocate(
        self,
        request_id: str,
        block_hashes: list[BlockHash],
        num_tokens: int,
        cls: RequestClass,
        now: float,
        num_prompt_tokens: int | None = None,
    ) -> Allocation:
        """Give ``request_id`` a block table covering ``num_tokens`` tokens.

        The longest cached prefix of ``block_hashes`` is shared (a hit); the rest are new
        blocks. With a host tier, the match runs on through the hashes that either tier
        holds (``_tier_run``): host blocks are promoted into new blocks at their positions
        (host hits), GPU blocks among them are shared. Raises ``OutOfBlocks`` without
        changing anything when space is short.

        Args:
            block_hashes: hashes of the prompt's full blocks, in order.
            num_tokens: tokens to hold now (prompt length, or prompt + output for a
                simulator that reserves the whole request).
            num_prompt_tokens: prompt length, to tell prefill blocks from decode blocks
                (defaults to ``num_tokens``).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has blocks")
        if num_tokens <= 0:
            raise ValueError("num_tokens must be positive")
        total = self.blocks_for_tokens(num_tokens)
        shared, needed, run, on_gpu = self._plan(block_hashes, total)
        hits = len(shared) - len(on_gpu)  # the GPU prefix
        host = self.host
        if not self._new_blocks_available(shared, needed):
            raise OutOfBlocks(f"need {needed} new blocks, {self.num_free_blocks} free")
        self.stats.query_blocks += len(block_hashes)
        self.stats.hit_blocks += len(shared)
        self.policy.on_request(cls, now)
        table: list[KVBlock] = []
        cached, on_access = self._cached, self.policy.on_access
        # NOTE: every shared block (the prefix and the GPU blocks inside the tier run) is
        # acquired before the new blocks are taken, so no victim is one of them.
        mid: dict[int, KVBlock] = {}
        for i, h in enumerate(shared):
            block = cached[h]
            on_access(block.block_id, cls, now)
            block.ref_cnt += 1
            if i < hits:
                table.append(block)
            else:
                mid[on_gpu[i - hits]] = block
        promoted = [i for i in range(hits, hits + run) if i not in mid]
        if host is not None and hits < total and self.enable_prefix_caching:
            host.policy.on_request(cls, now)
            # NOTE: taken (pinned) before the new blocks are, so the demotions that making
            # room may cause can neither evict nor overwrite a slot being promoted.
            slots = [host.take(block_hashes[i], cls, now) for i in promoted]
        if mid:
            fresh: list[KVBlock] = []
            self._take_free_blocks(needed, now, fresh)
            it = iter(fresh)
            table.extend(mid[i] if i in mid else next(it) for i in range(hits, total))
        else:
            self._take_free_blocks(needed, now, table)
        if run:
            self._promote(block_hashes, promoted, slots, table, now)
            hits += run
        host_hits = len(promoted)
        prompt_tokens = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        self._requests[request_id] = RequestBlocks(
            request_id=request_id,
            cls=cls,
            blocks=table,
            num_tokens=num_tokens,
            num_prompt_blocks=self.blocks_for_tokens(prompt_tokens),
            hashes=list(block_hashes),
            num_cached=hits,
        )
        return Allocation(tuple(b.block_id for b in table), hits, hits * self.block_size, host_hits)

    def _promote(
        self, block_hashes: list[BlockHash], positions: list[int], slots: list[int], table: list[KVBlock], now: float
    ) -> None:
        """Cache ``block_hashes[positions[k]]`` in ``table[positions[k]]`` (fresh blocks),
        copied from host slot ``slots[k]``; then the slots are free again. Positions rise,
        so each block's parent is cached (shared or just promoted) when it joins."""
        assert self.host is not None
        events = self._events if self.collect_events else None
        for i, slot in zip(positions, slots):
            block, h = table[i], block_hashes[i]
            parent_hash = self._cache_as(block, block_hashes, i, now)
            if events is not None:
                events.append(BlockRemoved(h, now, Tier.HOST))
                events.append(BlockStored(h, parent_hash, now))
            if self.record_transfers:
                self._transfers.append(Transfer(Tier.GPU, block.block_id, slot))
        self.host.release(slots)

    def _cache_as(self, block: KVBlock, block_hashes: list[BlockHash], i: int, now: float) -> BlockHash | None:
        """Make ``block`` the cached copy of ``block_hashes[i]``, linked to its parent block
        (``block_hashes[i - 1]``, parent id -1 when that is not cached), and tell the policy.
        Returns the parent hash (None for a first block); the caller emits the events."""
        h = block_hashes[i]
        parent_hash = block_hashes[i - 1] if i else None
        parent = self._cached.get(parent_hash) if i else None
        block.block_hash = h
        block.parent_hash = parent_hash
        block.parent_id = parent.block_id if parent is not None else -1
        self._cached[h] = block
        self.policy.on_cached(block.block_id, h, block.parent_id, now)
        return parent_hash

    def _take_free_block(self, now: float) -> KVBlock:
        taken: list[KVBlock] = []
        self._take_free_blocks(1, now, taken)
        return taken[0]

    def _take_free_blocks(self, n: int, now: float, out: list[KVBlock]) -> None:
        """Append ``n`` blocks with ref_cnt 1 to ``out``: uncached free blocks first,
        then the policy's victims (nothing refills the free queue meanwhile)."""
        free = self._free
        from_free = min(n, free.size)
        for _ in range(from_free):
            block = free.popleft()
            block.ref_cnt = 1
            out.append(block)
        if from_free == n:
            return
        # NOTE: the policy pops every victim before any is uncached; it never looks at
        # the store, so this is the order one pop_victim per block gave.
        victims = self.policy.pop_victims(n - from_free)
        blocks, cached, stats = self.blocks, self._cached, self.stats
        events = self._events if self.collect_events else None
        host = self.host
        for victim in victims:
            block = blocks[victim]
            h = block.block_hash
            assert block.ref_cnt == 0 and h is not None, f"policy returned busy block {victim}"
            # _uncache, written out: this loop is the simulator's hottest.
            del cached[h]
            block.block_hash = None
            block.parent_id = -1
            if events is not None:
                events.append(BlockRemoved(h, now))
            if host is not None:
                self._demote(block, h, now)
            stats.evictions += 1
            block.ref_cnt = 1
            out.append(block)
        if len(victims) < n - from_free:
            raise OutOfBlocks("no evictable block")

    def _demote(self, block: KVBlock, h: BlockHash, now: float) -> None:
        """Store victim ``block``'s hash ``h`` (already uncached) in the host tier."""
        assert self.host is not None
        info = block.release or ReleaseInfo(RequestClass(), 0, 1, False, now)
        parent = block.parent_hash
        slot, evicted = self.host.put(h, parent, info, now, parent is not None and parent in self._cached)
        block.release = None
        if slot is None:
            return
        if self.collect_events:
            if evicted is not None:
                self._events.append(BlockRemoved(evicted, now, Tier.HOST))
            self._events.append(BlockStored(h, block.parent_hash, now, Tier.HOST))
        if self.record_transfers:
            self._transfers.append(Transfer(Tier.HOST, block.block_id, slot))

    def _uncache(self, block: KVBlock, now: float) -> None:
        h = block.block_hash
        assert h is not None
        del self._cached[h]
        block.block_hash = None
        block.parent_id = -1
        if self.collect_events:
            self._events.append(BlockRemoved(h, now))

    def append_tokens(self, request_id: str, num_new_tokens: int, now: float) -> list[int]:
        """Grow a request by ``num_new_tokens`` slots (decode). Returns new block ids.

        Copy-on-write: if the partially filled last block is shared (a fork), the request
        gets a private copy first. Raises ``OutOfBlocks`` with nothing changed.
        """
        req = self._requests[request_id]
        old_tokens = req.num_tokens
        new_total = old_tokens + num_new_tokens
        needed = self.blocks_for_tokens(new_total) - len(req.blocks)
        last = req.blocks[-1] if req.blocks else None
        cow = last is not None and old_tokens % self.block_size != 0 and last.ref_cnt > 1 and num_new_tokens > 0
        if needed + int(cow) > self.num_free_blocks:
            raise OutOfBlocks(f"need {needed + int(cow)} blocks, {self.num_free_blocks} free")
        if cow:
            assert last is not None
            private = self._take_free_block(now)
            self.flush_transfers()  # the private block may be a victim whose demotion is queued
            self.storage.copy_block(last.block_id, private.block_id)
            last.ref_cnt -= 1
            req.blocks[-1] = private
        new_ids = []
        for _ in range(needed):
            block = self._take_free_block(now)
            req.blocks.append(block)
            new_ids.append(block.block_id)
        req.num_tokens = new_total
        return new_ids

    def add_block_hashes(self, request_id: str, hashes: list[BlockHash]) -> None:
        """Record hashes of blocks filled during decode (they follow the prompt's)."""
        self._requests[request_id].hashes.extend(hashes)

    def cache_blocks(self, request_id: str, now: float, upto: int | None = None) -> int:
        """Offer the request's full, hashed blocks to the prefix cache. Returns how many joined.

        Blocks join in order, so a cached block's parent is always cached. A hash another
        block already holds (two requests computed the same prefix) stays private.
        """
        if not self.enable_prefix_caching:
            return 0
        req = self._requests[request_id]
        limit = min(len(req.hashes), len(req.blocks), req.num_tokens // self.block_size)
        if upto is not None:
            limit = min(limit, upto)
        joined = 0
        blocks, hashes, cached = req.blocks, req.hashes, self._cached
        events = self._events if self.collect_events else None
        host = self.host
        for i in range(req.num_cached, limit):
            block = blocks[i]
            h = hashes[i]
            if block.block_hash is None and h not in cached:
                if host is not None and h in host:
                    # Recomputed on the GPU (the host copy lay past a broken chain): the
                    # GPU copy wins, the tiers stay exclusive.
                    host.discard(h)
                    if events is not None:
                        events.append(BlockRemoved(h, now, Tier.HOST))
                parent_hash = self._cache_as(block, hashes, i, now)
                if events is not None:
                    events.append(BlockStored(h, parent_hash, now))
                joined += 1
        req.num_cached = max(req.num_cached, limit)
        return joined

    def fork(self, parent_request_id: str, child_request_id: str, cls: RequestClass | None = None) -> None:
        """Share the parent's whole block table with a new request (n > 1 sampling)."""
        if child_request_id in self._requests:
            raise ValueError(f"request {child_request_id!r} already has blocks")
        parent = self._requests[parent_request_id]
        for b in parent.blocks:
            b.ref_cnt += 1
        self._requests[child_request_id] = RequestBlocks(
            request_id=child_request_id,
            cls=cls or parent.cls,
            blocks=list(parent.blocks),
            num_tokens=parent.num_tokens,
            num_prompt_blocks=parent.num_prompt_blocks,
            hashes=list(parent.hashes),
            num_cached=parent.num_cached,
        )

    def free(self, request_id: str, now: float) -> None:
        """Drop a request's references, tail block first (vLLM's order for LRU).

        Blocks that reach ref_cnt 0 go to the uncached free queue (no hash) or, in one
        ``on_release_many`` call after the loop, to the policy (hashed), each in tail-first
        order. NOTE: the two never look at each other, so doing the policy's part after
        the loop rather than interleaved changes nothing.
        """
        req = self._requests.pop(request_id)
        blocks = req.blocks
        free_append = self._free.append
        released: list[int] = []
        positions: list[int] = []
        n = len(blocks)
        for pos in range(n - 1, -1, -1):
            block = blocks[pos]
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            assert ref_cnt >= 0, f"block {block.block_id} ref_cnt < 0"
            if ref_cnt:
                continue
            if block.block_hash is None:
                free_append(block)
            else:
                released.append(block.block_id)
                positions.append(pos)
        if released:
            self.policy.on_release_many(released, positions, req.cls, n, req.num_prompt_blocks, now)
            if self.host is not None:
                blocks_by_id, cls, n_prompt = self.blocks, req.cls, req.num_prompt_blocks
                for block_id, pos in zip(released, positions):
                    blocks_by_id[block_id].release = ReleaseInfo(cls, pos, n, pos >= n_prompt, now)

    def reset_cache(self, now: float) -> int:
        """Evict every evictable cached block and empty the host tier (nothing is demoted).
        Returns how many GPU blocks were dropped."""
        dropped = 0
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self.policy.on_removed(block.block_id)
                self._uncache(block, now)
                block.release = None
                self._free.append(block)
                dropped += 1
        if self.host is not None:
            for h in self.host.clear():
                if self.collect_events:
                    self._events.append(BlockRemoved(h, now, Tier.HOST))
        if not self._cached and self.collect_events:
            self._events.append(AllBlocksCleared(now))
        return dropped

    # ----------------------------------------------------------------- events
    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def take_transfers(self) -> list[Transfer]:
        """The queued copies, oldest first (empty unless ``record_transfers``)."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def flush_transfers(self) -> int:
        """Run the queued copies on the storage as batched runs, in order. Returns how
        many copies were queued."""
        if not self._transfers:
            return 0
        transfers = self.take_transfers()
        self.storage.run_transfers(transfer_runs(transfers))  # type: ignore[attr-defined]
        return len(transfers)

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert the class invariants (tests; O(num_blocks))."""
        refs = [0] * self.num_blocks
        for req in self._requests.values():
            for b in req.blocks:
                refs[b.block_id] += 1
        free_ids = set(self._free.ids())
        assert len(free_ids) == self._free.size
        n_candidates = 0
        for b in self.blocks:
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != {refs[b.block_id]}"
            assert b.ref_cnt >= 0
            if b.block_hash is not None:
                assert self._cached.get(b.block_hash) is b, f"block {b.block_id} hash not mapped"
                assert b.block_id not in free_ids
                if b.ref_cnt == 0:
                    n_candidates += 1
            elif b.ref_cnt == 0:
                assert b.block_id in free_ids, f"block {b.block_id} lost: unreferenced, uncached, not free"
            if b.ref_cnt > 0:
                assert b.block_id not in free_ids
        assert len(self._cached) == sum(1 for b in self.blocks if b.block_hash is not None)
        assert n_candidates == len(self.policy), f"policy holds {len(self.policy)} candidates, store {n_candidates}"
        assert self.num_free_blocks + sum(1 for r in refs if r) == self.num_blocks
        if self.host is not None:
            self.host.check_invariants()
            both = [h for h in self._cached if h in self.host]
            assert not both, f"{len(both)} hashes in both tiers"
