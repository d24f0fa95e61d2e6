"""Exact outcomes of the paged KV store (with vLLM-order LRU eviction)."""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import Allocation, KVStore, OutOfBlocks

BS = 4


def make_store(num_blocks: int = 8) -> KVStore:
    return KVStore(num_blocks, BS, make_policy("lru"))


def toks(*block_values: int, extra: int = 0) -> list[int]:
    """Token ids: one full block per value (all tokens equal to it), plus ``extra`` tokens."""
    out = [v for v in block_values for _ in range(BS)]
    return out + [999] * extra


def admit(store, rid, tokens, now=0.0, salt=None, cache=True):
    hashes = hash_token_blocks(tokens, BS, cache_salt=salt)
    alloc = store.allocate(rid, hashes, len(tokens), SINGLE_TURN, now)
    if cache:
        store.cache_blocks(rid, now)
    return alloc


def test_allocate_hit_and_free_order():
    store = make_store()
    a = admit(store, "a", toks(1, 2, extra=2))
    assert a == Allocation((0, 1, 2), 0, 0)
    store.free("a", 1.0)
    # Tail first: the partial block 2 goes back to the uncached free queue's end, the
    # hashed blocks become LRU candidates tail (1) before head (0).
    assert store._free.ids() == [3, 4, 5, 6, 7, 2]
    assert store.policy.order() == [1, 0]
    b = admit(store, "b", toks(1, 2, 3))
    assert b == Allocation((0, 1, 3), 2, 8)
    assert store.policy.order() == []
    assert (store.stats.query_blocks, store.stats.hit_blocks) == (5, 2)
    store.check_invariants()


def test_eviction_takes_lru_victims_tail_first_when_free_queue_is_empty():
    store = make_store(4)
    admit(store, "a", toks(1, 2))
    store.free("a", 1.0)
    admit(store, "b", toks(3, 4))
    store.free("b", 2.0)
    assert store.policy.order() == [1, 0, 3, 2]
    c = admit(store, "c", toks(5, 6, 7))
    assert c.block_ids == (1, 0, 3)
    assert store.stats.evictions == 3
    assert store.policy.order() == [2]
    store.check_invariants()


def test_fork_then_append_copies_the_shared_partial_block():
    store = make_store()
    admit(store, "a", toks(1, extra=2))  # 6 tokens: blocks 0 (full) and 1 (partial)
    store.fork("a", "b")
    assert [store.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    new = store.append_tokens("b", 1, 1.0)
    assert new == []
    assert store.block_table("b") == [0, 2]
    assert store.block_table("a") == [0, 1]
    assert store.storage.copies == [(1, 2)]
    assert [store.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    # The parent owns its partial block alone now: appending to it copies nothing.
    store.append_tokens("a", 1, 1.0)
    assert store.storage.copies == [(1, 2)]
    store.check_invariants()


def test_append_grows_on_demand():
    store = make_store()
    admit(store, "a", toks(1))
    assert store.append_tokens("a", 1, 0.0) == [1]
    assert store.append_tokens("a", 3, 0.0) == []
    assert store.append_tokens("a", 1, 0.0) == [2]
    assert store.block_table("a") == [0, 1, 2]
    assert store.request("a").num_tokens == 9


def _snapshot(store):
    return (
        store._free.ids(),
        list(store.policy.order()),
        {rid: store.block_table(rid) for rid in store._requests},
        [b.ref_cnt for b in store.blocks],
        dict(store._cached),
        (store.stats.query_blocks, store.stats.hit_blocks, store.stats.evictions),
        list(store._events),
    )


def test_out_of_blocks_leaves_the_store_unchanged():
    store = make_store(4)
    admit(store, "a", toks(1, 2))
    store.free("a", 1.0)
    admit(store, "b", toks(3))
    before = _snapshot(store)
    with pytest.raises(OutOfBlocks):
        admit(store, "c", toks(1, 2, 7, 8))  # 2 hits + 2 new, but hits use the 2 candidates
    with pytest.raises(OutOfBlocks):
        store.append_tokens("b", 16, 2.0)
    assert _snapshot(store) == before
    assert not store.has_request("c")
    store.check_invariants()


def test_events_are_collected_until_taken():
    store = make_store(3)
    h = hash_token_blocks(toks(1, 2), BS)
    admit(store, "a", toks(1, 2), now=1.0)
    assert store.take_events() == [BlockStored(h[0], None, 1.0), BlockStored(h[1], h[0], 1.0)]
    assert store.take_events() == []
    store.free("a", 2.0)
    admit(store, "b", toks(5, 6), now=3.0)  # 1 free block + evicts block 1 (tail) first
    events = store.take_events()
    assert events[0] == BlockRemoved(h[1], 3.0)
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockStored]
    store.free("b", 4.0)
    assert store.reset_cache(5.0) == 3
    assert store.take_events()[-1] == AllBlocksCleared(5.0)
    assert store.num_cached_blocks == 0
    store.check_invariants()


def test_collect_events_off_queues_nothing_and_changes_no_outcome():
    stores = [make_store(3), KVStore(3, BS, make_policy("lru"), collect_events=False)]
    outcomes = []
    for store in stores:
        a = admit(store, "a", toks(1, 2), now=1.0)
        store.free("a", 2.0)
        b = admit(store, "b", toks(5, 6), now=3.0)  # evicts
        store.free("b", 4.0)
        c = admit(store, "c", toks(5, 6), now=5.0)  # hits
        store.free("c", 6.0)
        dropped = store.reset_cache(7.0)
        outcomes.append((a, b, c, dropped, store.stats))
        store.check_invariants()
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][1].block_ids == (2, 1)  # the free block, then the evicted tail
    assert stores[0].take_events() != []
    assert stores[1].take_events() == []


def test_salt_keeps_tenants_apart():
    store = make_store()
    admit(store, "a", toks(1, 2, 3), salt=b"tenant-a")
    store.free("a", 1.0)
    other = admit(store, "b", toks(1, 2, 3), salt=b"tenant-b")
    assert other.num_hit_blocks == 0
    same = admit(store, "c", toks(1, 2, 3), salt=b"tenant-a")
    assert same.num_hit_blocks == 3
    assert same.block_ids == (0, 1, 2)


def test_duplicate_prefix_computed_twice_stays_private():
    store = make_store()
    admit(store, "a", toks(1, 2))
    admit(store, "b", toks(1, 2))  # a still running: b hits a's blocks
    assert store.block_table("b") == [0, 1]
    store.free("a", 1.0)
    store.free("b", 1.0)
    assert store.policy.order() == [1, 0]
    store.check_invariants()


def test_prefix_caching_off_never_hits():
    store = KVStore(8, BS, make_policy("lru"), enable_prefix_caching=False)
    admit(store, "a", toks(1, 2))
    store.free("a", 1.0)
    assert admit(store, "b", toks(1, 2)).num_hit_blocks == 0
    assert store.num_cached_blocks == 0
