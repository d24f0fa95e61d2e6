"""Exact eviction orders of the classic baselines (fifo, lfu, arc, s3fifo, lecar) on small
hand-built cases. The store's invariants for each run in tests/replica/test_kv_store_properties.py."""

from __future__ import annotations

import math

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.arc import ARCPolicy
from unicache.replica.eviction.base import ReleaseInfo
from unicache.replica.eviction.fifo import FIFOPolicy
from unicache.replica.eviction.lecar import LFU, LRU, LeCaRPolicy
from unicache.replica.eviction.lfu import LFUPolicy
from unicache.replica.eviction.registry import make_policy
from unicache.replica.eviction.s3fifo import S3FIFOPolicy

H = hash_id_blocks(list(range(100)), 1)  # H[i]: a distinct hash per id


def cache(p, *ids, hashes=None):
    for i, b in enumerate(ids):
        p.on_cached(b, hashes[i] if hashes else H[b], -1, 0.0)


def release(p, ids, now=0.0):
    """Release one request's blocks tail first, as the store does."""
    for pos in range(len(ids) - 1, -1, -1):
        p.on_release(ids[pos], ReleaseInfo(SINGLE_TURN, pos, len(ids), False, now))


def hit(p, *ids):
    for b in ids:
        p.on_access(b, SINGLE_TURN, 0.0)


def drain(p):
    out = []
    while (v := p.pop_victim()) is not None:
        out.append(v)
    return out


# ------------------------------------------------------------------ fifo
def test_fifo_keeps_first_release_order_across_hits():
    p = FIFOPolicy()
    cache(p, 0, 1, 2, 3, 4)
    release(p, [0, 1, 2])
    release(p, [3, 4])
    hit(p, 1)
    release(p, [1])  # back to its original place (lru would put it last)
    hit(p, 3)  # referenced: not a candidate
    assert drain(p) == [2, 1, 0, 4]
    release(p, [3])
    assert drain(p) == [3]


# ------------------------------------------------------------------- lfu
def test_lfu_least_used_first_ties_by_release_order_and_aging_on_victims():
    p = LFUPolicy()
    cache(p, 0, 1, 2)
    release(p, [0, 1, 2])  # keys 1, 1, 1
    hit(p, 0, 1)
    release(p, [0, 1])  # keys 2, 2
    hit(p, 0)
    release(p, [0])  # key 3
    assert p.pop_victim() == 2 and p.cache_age == 1.0
    cache(p, 3)
    release(p, [3])  # key L + 1 = 2: ties with block 1, released earlier
    assert drain(p) == [1, 3, 0]


def test_lfu_aging_lets_a_stream_of_new_blocks_evict_an_old_popular_one():
    p = LFUPolicy()
    cache(p, 0)
    release(p, [0])
    for _ in range(4):
        hit(p, 0)
        release(p, [0])  # 5 uses: key 5
    victims = []
    for b in range(10, 15):
        cache(p, b)
        release(p, [b])  # key L + 1, L rising by one per victim
        victims.append(p.pop_victim())
    assert victims == [10, 11, 12, 13, 0]


# ------------------------------------------------------------------- arc
def test_arc_recency_list_first_then_frequency_list():
    p = ARCPolicy()
    cache(p, 0, 1)
    release(p, [0, 1])
    hit(p, 0)  # used again: T2
    release(p, [0])
    cache(p, 2)
    release(p, [2])
    assert p.queue_sizes() == {"t1": 2, "t2": 1}
    assert drain(p) == [1, 2, 0]
    assert (list(p._b1), list(p._b2)) == ([H[1], H[2]], [H[0]])


def test_arc_ghost_hit_in_recency_history_grows_the_recency_target():
    p = ARCPolicy()
    cache(p, 0, 1)
    release(p, [0, 1])
    hit(p, 0)
    release(p, [0])
    cache(p, 2)
    release(p, [2])
    drain(p)  # B1 = [h1, h2], B2 = [h0], p = 0, c = 3
    cache(p, 5, hashes=[H[1]])  # a B1 ghost: p += max(|B2| / |B1|, 1) = 1; 5 joins T2
    release(p, [5])
    cache(p, 6)
    release(p, [6])
    assert p.p == 1.0
    # |T1| = 1 is not above p = 1: the T2 block goes first.
    assert drain(p) == [5, 6]
    cache(p, 7, hashes=[H[0]])  # a B2 ghost: p -= max(|B1| / |B2|, 1)
    assert p.p == 0.0


# ---------------------------------------------------------------- s3fifo
def test_s3fifo_one_hit_blocks_leave_from_the_small_queue_hit_ones_move_to_main():
    p = S3FIFOPolicy()
    cache(p, *range(10))  # c = 10: the small queue's share is 1 block
    release(p, list(range(10)))  # small queue, tail first: 9, 8, ..., 0
    hit(p, 5)
    release(p, [5])
    assert drain(p) == [9, 8, 7, 6, 4, 3, 2, 1, 0, 5]  # 5 went to main on its way out
    cache(p, 20, hashes=[H[9]])  # a ghost: enters main
    cache(p, 21)
    release(p, [20])
    release(p, [21])
    assert p.queue_sizes() == {"small": 1, "main": 1}
    assert drain(p) == [21, 20]


def test_s3fifo_main_queue_reinserts_blocks_with_a_count_and_parks_referenced_ones():
    p = S3FIFOPolicy(small_frac=0.5)
    cache(p, 0, 1, 2, 3)  # c = 4: the small queue may hold 2
    release(p, [0, 1, 2, 3])  # small: 3, 2, 1, 0
    hit(p, 3, 2)
    release(p, [3, 2])
    hit(p, 3)  # 3: count 2, referenced
    # Small holds 4 >= 2: 3 and 2 (hit) move to main (count reset to 0), 1 leaves.
    assert p.pop_victim() == 1
    # Small (1 block) is under its share: main's oldest, 3, is referenced with count 0,
    # so it is parked; 2 leaves. Then main is empty: 0 leaves from small.
    assert [p.pop_victim(), p.pop_victim()] == [2, 0]
    assert p.pop_victim() is None and len(p) == 0
    release(p, [3])  # back at main's head
    assert drain(p) == [3]


# ----------------------------------------------------------------- lecar
def test_lecar_agreeing_experts_evict_lru_order_without_history():
    p = LeCaRPolicy()
    cache(p, 0, 1, 2)
    release(p, [0, 1, 2])
    assert drain(p) == [2, 1, 0]
    assert p._history == ({}, {}) and p.weights == [0.5, 0.5]


def test_lecar_regret_shifts_weight_away_from_the_expert_that_erred():
    p = LeCaRPolicy(seed=0)  # random.Random(0).random() = 0.844 >= w_lru: the LFU expert
    cache(p, 0, 1)
    release(p, [0])
    hit(p, 0, 0)
    release(p, [0])  # 0: released first (LRU victim), 3 uses
    release(p, [1])  # 1: 1 use (LFU victim)
    assert p.pop_victim() == 1
    assert list(p._history[LFU]) == [H[1]]
    cache(p, 7, hashes=[H[1]])  # LFU's victim came back: LFU's regret
    discount = 0.005 ** (1 / 2)  # c = 2 blocks cached at most
    w_lfu = 0.5 * math.exp(-0.45 * discount**1)  # one block cached since the eviction
    assert p.weights[LFU] == pytest.approx(w_lfu / (0.5 + w_lfu))
    assert p.weights[LRU] == pytest.approx(0.5 / (0.5 + w_lfu))
    assert p._uses[7] == 2  # its use count resumed from the history


# --------------------------------------------------------------- shared
@pytest.mark.parametrize("name", ["fifo", "lfu", "lecar"])
def test_keyed_heaps_stay_bounded_under_hit_release_cycles(name):
    p = make_policy(name)
    cache(p, 0)
    for _ in range(10_000):
        release(p, [0])
        hit(p, 0)
    release(p, [0])
    assert len(p._lfu.heap if name == "lecar" else p._candidates.heap) <= 2 * 1 + 64
    assert drain(p) == [0]


@pytest.mark.parametrize("name", ["fifo", "lfu", "arc", "s3fifo", "lecar"])
def test_removed_blocks_leave_and_unknown_ones_are_ignored(name):
    p = make_policy(name)
    cache(p, 0, 1, 2)
    release(p, [0, 1, 2])
    p.on_removed(1)
    p.on_removed(99)
    assert len(p) == 2
    assert sorted(drain(p)) == [0, 2]
    assert len(p) == 0 and p.pop_victim() is None


def test_s3fifo_main_queue_gives_a_hit_block_another_round():
    p = S3FIFOPolicy(small_frac=0.5)
    cache(p, 0, 1, 2, 3)  # c = 4: the small queue may hold 2
    release(p, [0, 1, 2, 3])  # small: 3, 2, 1, 0
    hit(p, 3, 2)
    release(p, [3, 2])
    assert p.pop_victim() == 1  # 3 and 2 moved to main (count reset), 1 left
    hit(p, 3)
    release(p, [3])  # main: 3 (count 1), 2 (count 0)
    # 3 is main's oldest but has a count: back to main's head with count 0; 2 leaves.
    assert drain(p) == [2, 3, 0]
