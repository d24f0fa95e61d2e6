"""Hypothesis: random operation sequences keep the KV store's invariants, for every policy."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.block_hash import hash_token_blocks
from unicache.request_class import RequestClass, Task
from unicache.replica.eviction.opt import FutureAccesses
from unicache.replica.eviction.registry import make_policy, policy_names
from unicache.replica.kv.store import KVStore, OutOfBlocks

BS = 2
NUM_BLOCKS = 12

CLASSES = [
    RequestClass(),
    RequestClass(session_id="s", turn=1, task=Task.CHAT),
    RequestClass(session_id="g", turn=2, task=Task.AGENT),
    RequestClass(template=True, template_blocks=2, task=Task.TOOL),
]


def build_policy(name: str):
    if name == "opt":
        return make_policy("opt", future=FutureAccesses({}))
    if name == "unicache":
        return make_policy("unicache", update_every=1)
    return make_policy(name)


op = st.one_of(
    st.tuples(st.just("alloc"), st.lists(st.integers(0, 2), min_size=1, max_size=14), st.integers(0, 3)),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(1, 5)),
    st.tuples(st.just("cache"), st.integers(0, 7)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("reset")),
)


def run_ops(policy_name: str, ops) -> None:
    store = KVStore(NUM_BLOCKS, BS, build_policy(policy_name))
    live: list[str] = []
    next_id = 0
    now = 0.0
    for o in ops:
        now += 1.0
        kind = o[0]
        if kind == "alloc":
            tokens, cls_i = o[1], o[2]
            rid = f"r{next_id}"
            next_id += 1
            hashes = hash_token_blocks(tokens, BS)
            free_before = store.num_free_blocks
            try:
                store.allocate(rid, hashes, len(tokens), CLASSES[cls_i], now)
                live.append(rid)
            except OutOfBlocks:
                assert store.num_free_blocks == free_before
                assert not store.has_request(rid)
        elif not live and kind in ("append", "cache", "fork", "free"):
            continue
        elif kind == "append":
            rid = live[o[1] % len(live)]
            try:
                store.append_tokens(rid, o[2], now)
            except OutOfBlocks:
                pass
        elif kind == "cache":
            store.cache_blocks(live[o[1] % len(live)], now)
        elif kind == "fork":
            child = f"r{next_id}"
            next_id += 1
            store.fork(live[o[1] % len(live)], child)
            live.append(child)
        elif kind == "free":
            store.free(live.pop(o[1] % len(live)), now)
        elif kind == "reset":
            store.reset_cache(now)
        store.check_invariants()
        assert all(b.ref_cnt >= 0 for b in store.blocks)
        assert 0 <= store.num_free_blocks <= NUM_BLOCKS
        assert store.num_cached_blocks <= NUM_BLOCKS
        assert sum(store.policy.queue_sizes().values()) == len(store.policy)
    for rid in live:
        store.free(rid, now + 1.0)
    store.check_invariants()
    # Nothing lost: every block is free or an eviction candidate again.
    assert store.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("policy_name", policy_names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40))
def test_random_operations_keep_invariants(policy_name, ops):
    run_ops(policy_name, ops)


def test_every_required_policy_is_covered():
    assert {"lru", "radix-lru", "unicache", "opt"} <= set(policy_names())
