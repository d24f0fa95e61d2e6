"""Exact eviction orders of radix-lru and opt, on the policies alone and through the store."""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import BlockHash, hash_id_blocks
from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.base import ReleaseInfo
from unicache.replica.eviction.opt import NEVER, FutureAccesses, OptPolicy
from unicache.replica.eviction.radix_lru import RadixLRUPolicy
from unicache.replica.eviction.registry import make_policy, policy_names
from unicache.replica.kv.store import KVStore


def H(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def rel(now: float, pos: int = 0) -> ReleaseInfo:
    return ReleaseInfo(SINGLE_TURN, pos, 1, False, now)


def drain(policy) -> list[int]:
    out = []
    while (v := policy.pop_victim()) is not None:
        out.append(v)
    return out


def test_registered():
    assert {"radix-lru", "opt"} <= set(policy_names())
    assert isinstance(make_policy("radix-lru"), RadixLRUPolicy)
    assert isinstance(make_policy("opt", future=FutureAccesses({})), OptPolicy)


# ------------------------------------------------------------------ radix-lru
def test_radix_evicts_leaves_before_an_older_parent():
    p = RadixLRUPolicy()
    p.on_cached(0, H(0), -1, 0.0)
    p.on_cached(1, H(1), 0, 0.0)
    p.on_cached(2, H(2), 1, 0.0)
    p.on_cached(3, H(3), 0, 0.0)
    p.on_release(0, rel(1.0))  # the root is the oldest, but not a leaf
    p.on_release(1, rel(2.0))
    p.on_release(3, rel(3.0))
    p.on_release(2, rel(4.0))
    assert p.order() == [3, 2, 1, 0]
    assert drain(p) == [3, 2, 1, 0]
    assert len(p) == 0


def test_radix_access_refreshes_and_pins():
    p = RadixLRUPolicy()
    for b in range(3):
        p.on_cached(b, H(b), -1, 0.0)
        p.on_release(b, rel(float(b)))
    p.on_access(0, SINGLE_TURN, 5.0)  # pinned again: no longer a candidate
    assert len(p) == 2
    assert p.order() == [1, 2]
    p.on_release(0, rel(6.0))
    assert drain(p) == [1, 2, 0]


def test_radix_child_cached_under_candidate_makes_it_non_leaf():
    p = RadixLRUPolicy()
    p.on_cached(0, H(0), -1, 0.0)
    p.on_release(0, rel(1.0))
    p.on_cached(1, H(1), -1, 0.0)
    p.on_release(1, rel(2.0))
    p.on_cached(2, H(2), 0, 3.0)  # block 2 extends block 0 and is pinned
    assert p.pop_victim() == 1  # 0 is older but has a cached child
    # only a non-leaf candidate is left: the fallback still returns it
    assert p.pop_victim() == 0
    assert p.pop_victim() is None
    p.on_release(2, rel(4.0))  # 2's parent is gone: 2 is a root leaf now
    assert drain(p) == [2]


def test_radix_removed_block_id_reuse_inherits_nothing():
    p = RadixLRUPolicy()
    p.on_cached(0, H(0), -1, 0.0)
    p.on_cached(1, H(1), 0, 0.0)
    p.on_release(0, rel(1.0))
    p.on_removed(0)  # e.g. reset
    p.on_cached(0, H(9), -1, 2.0)  # id 0 reused for another hash, no children
    p.on_release(0, rel(2.0))
    p.on_release(1, rel(3.0))
    assert drain(p) == [0, 1]


def _one_block_request(store: KVStore, rid: str, hid: int, now: float) -> None:
    hashes = hash_id_blocks([hid])
    store.allocate(rid, hashes, 4, SINGLE_TURN, now)
    store.cache_blocks(rid, now)


@pytest.mark.parametrize("policy, expected", [("lru", [0, 2]), ("radix-lru", [2, 0])])
def test_store_private_parent_copy_lru_vs_radix(policy, expected):
    """R2 computed h0 privately (R1's copy was not cached yet), so its cached h1 hangs
    under R1's block 0. R1 is released first: LRU evicts the parent 0 first, radix-lru
    the leaf 2 first."""
    store = KVStore(4, 4, make_policy(policy))
    h = hash_id_blocks([10, 11])
    store.allocate("r1", h[:1], 4, SINGLE_TURN, 0.0)  # block 0
    store.allocate("r2", h, 8, SINGLE_TURN, 0.0)  # blocks 1, 2 (no hit: nothing cached)
    assert store.block_table("r2") == [1, 2]
    store.cache_blocks("r1", 1.0)
    store.cache_blocks("r2", 1.0)  # block 1 stays private (h0 already held by block 0)
    assert store.blocks[2].parent_id == 0
    store.free("r1", 2.0)
    store.free("r2", 3.0)
    assert store.policy.order() == expected
    store.check_invariants()
    # Two new one-block requests take the uncached blocks 3 and 1 first, then evict.
    for i, hid in enumerate((20, 21, 22)):
        _one_block_request(store, f"n{i}", hid, 4.0 + i)
    assert store.stats.evictions == 1
    survivor = expected[1]
    assert store.blocks[survivor].block_hash == h[survivor // 2]
    store.check_invariants()


# ------------------------------------------------------------------------ opt
def test_future_accesses_next_use():
    fut = FutureAccesses.from_prompts([[H(1), H(2)], [H(1)], [H(3), H(1)]])
    assert fut.next_use(H(1)) == 0
    fut.clock = 0
    assert fut.next_use(H(1)) == 1
    assert fut.next_use(H(2)) == NEVER
    fut.clock = 1
    assert fut.next_use(H(1)) == 2
    assert fut.next_use(H(3)) == 2
    assert fut.next_use(H(99)) == NEVER


def test_opt_evicts_furthest_next_use_first():
    fut = FutureAccesses({H(0): [5], H(1): [2], H(2): [], H(3): [9]})
    p = OptPolicy(fut)
    for b in range(4):
        p.on_cached(b, H(b), -1, 0.0)
    fut.clock = 0
    for b in range(4):
        p.on_release(b, rel(0.0))
    assert drain(p) == [2, 3, 0, 1]


def test_opt_prefers_the_deeper_block_on_equal_next_use():
    fut = FutureAccesses({H(0): [4], H(1): [4], H(2): [4]})
    p = OptPolicy(fut)
    p.on_cached(0, H(0), -1, 0.0)
    p.on_cached(1, H(1), 0, 0.0)
    p.on_cached(2, H(2), 1, 0.0)
    fut.clock = 0
    for b in (0, 1, 2):  # parent released first: order must still be deepest first
        p.on_release(b, rel(0.0))
    assert drain(p) == [2, 1, 0]


def test_opt_refreshes_a_next_use_that_passed_without_a_hit():
    fut = FutureAccesses({H(0): [2, 9], H(1): [5]})
    p = OptPolicy(fut)
    p.on_cached(0, H(0), -1, 0.0)
    p.on_cached(1, H(1), -1, 0.0)
    fut.clock = 0
    p.on_release(0, rel(0.0))  # next use 2
    p.on_release(1, rel(0.0))  # next use 5
    fut.clock = 3  # request 2 went by without hitting block 0: its next use is now 9
    assert p.pop_victim() == 0
    assert p.pop_victim() == 1


def test_opt_access_removes_candidate():
    fut = FutureAccesses({H(0): [1], H(1): [3]})
    p = OptPolicy(fut)
    for b in range(2):
        p.on_cached(b, H(b), -1, 0.0)
        p.on_release(b, rel(0.0))
    p.on_access(1, SINGLE_TURN, 1.0)
    assert len(p) == 1
    assert drain(p) == [0]
    p.on_removed(1)
    assert len(p) == 0 and p.pop_victim() is None


# ------------------------------------------------------- property-based checks
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from unicache.replica.kv.store import OutOfBlocks  # noqa: E402


class CheckedRadix(RadixLRUPolicy):
    """Checks every victim against a brute-force scan of the candidates."""

    def pop_victim(self):
        times = {b: self._last_use[b] for b in self._candidates if not self._children.get(b)}
        oldest = next(iter(self._candidates), None)
        victim = super().pop_victim()
        if times:
            assert victim in times and times[victim] == min(times.values())
        else:
            assert victim == oldest
        return victim


class CheckedOpt(OptPolicy):
    """Checks every victim's next use is the furthest among the candidates'."""

    def pop_victim(self):
        next_uses = {b: self.future.next_use(self._hash[b]) for b in self._token}
        victim = super().pop_victim()
        if next_uses:
            assert next_uses[victim] == max(next_uses.values())
        return victim


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "finish", "fork"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=4),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=40,
)


def _drive(policy_factory, steps):
    prompts = [hash_id_blocks(ids) for _, ids, _ in steps]
    future = FutureAccesses.from_prompts(prompts)
    policy = policy_factory(future)
    store = KVStore(5, 2, policy)
    live: list[str] = []
    for i, (op, ids, extra) in enumerate(steps):
        now = float(i)
        future.clock = i
        if op == "alloc":
            hashes = prompts[i]
            tokens = 2 * len(hashes) + extra
            fits = store.can_allocate(hashes, tokens)
            try:
                store.allocate(f"r{i}", hashes, tokens, SINGLE_TURN, now, num_prompt_tokens=2 * len(hashes))
            except OutOfBlocks:
                assert not fits
            else:
                assert fits
                store.cache_blocks(f"r{i}", now)
                live.append(f"r{i}")
        elif op == "fork" and live:
            store.fork(live[extra % len(live)], f"f{i}")
            live.append(f"f{i}")
        elif live:
            store.free(live.pop(extra % len(live)), now)
        store.check_invariants()
    for rid in live:
        store.free(rid, 99.0)
    store.check_invariants()
    candidates = len(store.policy)
    assert len(drain(store.policy)) == candidates and len(store.policy) == 0


@settings(max_examples=150, deadline=None)
@given(ops)
def test_radix_lru_through_the_store_keeps_invariants(steps):
    _drive(lambda future: CheckedRadix(), steps)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_opt_through_the_store_evicts_the_furthest_next_use(steps):
    _drive(CheckedOpt, steps)


def test_radix_lru_heap_stays_bounded_under_hit_release_cycles():
    p = RadixLRUPolicy()
    p.on_cached(0, hash_id_blocks([1])[0], -1, 0.0)
    for i in range(100_000):
        p.on_release(0, ReleaseInfo(SINGLE_TURN, 0, 1, False, float(i)))
        p.on_access(0, SINGLE_TURN, i + 0.5)
    assert len(p._heap) <= 2 * len(p._token) + 64
    p.on_cached(1, hash_id_blocks([2])[0], -1, 1e6)
    p.on_release(1, ReleaseInfo(SINGLE_TURN, 0, 1, False, 1e6 + 1))
    p.on_release(0, ReleaseInfo(SINGLE_TURN, 0, 1, False, 1e6 + 2))
    assert p.order() == [1, 0]
