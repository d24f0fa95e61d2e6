"""Hypothesis: random operation sequences keep the KV store's invariants, for every policy,
single-tier and with a host tier (every host policy under lru and unicache GPU tiers).

With a host tier a content model runs alongside: each GPU block and host slot holds the
hash whose KV it contains, written by "prefill" (the blocks a request computes), by
copy-on-write and by the store's transfers applied as the engine batches them
(``KVStore.flush_transfers``, batched by ``transfer_runs``). After every operation each cached block, in either tier, must hold
its own hash's content, and each block a request hit must hold the hash it hit.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.kv_tier import Tier
from unicache.contract.request_class import RequestClass, Task
from unicache.replica.eviction.opt import FutureAccesses
from unicache.replica.eviction.registry import make_host_policy, make_policy, policy_names
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.store import KVStore, OutOfBlocks

BS = 2
NUM_BLOCKS = 12

CLASSES = [
    RequestClass(),
    RequestClass(session_id="s", turn=1, task=Task.CHAT),
    RequestClass(session_id="g", turn=2, task=Task.AGENT),
    RequestClass(template=True, template_blocks=2, task=Task.TOOL),
]


def build_host_policy(name: str):
    """What a host tier runs under ``name`` (unicache: the host-side UniCache)."""
    if name == "opt":
        return make_policy("opt", future=FutureAccesses({}))
    return make_host_policy(name)


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

# A whole request's life (allocate, cache, free) of one prompt from a small pool: builds up
# evictable cached blocks quickly and asks for them again, so evictions, demotions and
# promotions happen.
run_op = st.tuples(st.just("run"), st.integers(0, 5), st.integers(0, 3))
prompt_pool = st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=10), min_size=2, max_size=6)
two_tier_op = st.one_of(
    run_op,
    run_op,
    run_op,
    st.tuples(st.just("alloc"), st.lists(st.integers(0, 1), min_size=1, max_size=6), st.integers(0, 3)),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(1, 3)),
    st.tuples(st.just("cache"), st.integers(0, 7)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("reset")),
)


class ContentModel:
    """Which hash's KV each GPU block and host slot holds (None: nothing known)."""

    def __init__(self, num_blocks: int, host_blocks: int):
        self.num_blocks = num_blocks
        self.gpu: list = [None] * num_blocks
        self.host: list = [None] * host_blocks

    def copy_block(self, src: int, dst: int) -> None:  # the store's COW hook
        self.gpu[dst] = self.gpu[src]

    def apply(self, store: KVStore) -> None:
        store.flush_transfers()

    def run_transfers(self, runs) -> None:  # the storage's side of flush_transfers
        for run in runs:
            src, dst = (self.gpu, self.host) if run.tier is Tier.HOST else (self.host, self.gpu)
            values = [src[i] for i in run.src]  # gather, then scatter: one batched copy
            for i, v in zip(run.dst, values):
                dst[i] = v

    def check(self, store: KVStore) -> None:
        for b in store.blocks:
            if b.block_hash is not None:
                assert self.gpu[b.block_id] == b.block_hash, f"GPU block {b.block_id} holds other KV"
        for h in store.host_hashes():
            assert self.host[store.host.slot_of(h)] == h, "host slot holds other KV"


def run_ops(policy_name: str, ops, host_blocks: int = 0, host_policy: str = "lru",
            num_blocks: int = NUM_BLOCKS, prompts=()) -> None:
    host = HostTier(host_blocks, build_host_policy(host_policy)) if host_blocks else None
    model = ContentModel(num_blocks, host_blocks)
    store = KVStore(num_blocks, BS, build_policy(policy_name), storage=model, host=host,
                    record_transfers=host is not None)
    live: list[str] = []
    next_id = 0
    now = 0.0
    for o in ops:
        now += 1.0
        kind = o[0]
        if kind in ("alloc", "run"):
            tokens, cls_i = (prompts[o[1] % len(prompts)] if kind == "run" else o[1]), o[2]
            rid = f"r{next_id}"
            next_id += 1
            hashes = hash_token_blocks(tokens, BS)
            free_before = store.num_free_blocks
            try:
                alloc = store.allocate(rid, hashes, len(tokens), CLASSES[cls_i], now)
                live.append(rid)
                model.apply(store)
                for i, block_id in enumerate(alloc.block_ids):
                    if i < alloc.num_hit_blocks:
                        assert model.gpu[block_id] == hashes[i], f"hit block {i} holds other KV"
                    else:  # prefill computes the rest
                        model.gpu[block_id] = hashes[i] if i < len(hashes) else None
                if kind == "run":
                    store.cache_blocks(rid, now)
                    store.free(live.pop(), now)
            except OutOfBlocks:
                assert store.num_free_blocks == free_before
                assert not store.has_request(rid)
        elif not live and kind in ("append", "cache", "fork", "free"):
            continue
        elif kind == "append":
            rid = live[o[1] % len(live)]
            try:
                new_ids = store.append_tokens(rid, o[2], now)
                model.apply(store)  # the engine copies before decode writes the new blocks
                for block_id in new_ids:
                    model.gpu[block_id] = None  # decode writes KV no hash names
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
        model.apply(store)
        model.check(store)
        store.check_invariants()
        assert all(b.ref_cnt >= 0 for b in store.blocks)
        assert 0 <= store.num_free_blocks <= num_blocks
        assert store.num_cached_blocks <= num_blocks
        assert sum(store.policy.queue_sizes().values()) == len(store.policy)
    for rid in live:
        store.free(rid, now + 1.0)
    store.check_invariants()
    # Nothing lost: every block is free or an eviction candidate again.
    assert store.num_free_blocks == num_blocks


@pytest.mark.parametrize("policy_name", policy_names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40))
def test_random_operations_keep_invariants(policy_name, ops):
    run_ops(policy_name, ops)


@pytest.mark.parametrize("gpu_policy", ["lru", "unicache"])
@pytest.mark.parametrize("host_policy", policy_names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(two_tier_op, min_size=10, max_size=40), host_blocks=st.integers(1, 8), prompts=prompt_pool)
def test_two_tier_random_operations_keep_invariants_and_contents(gpu_policy, host_policy, ops, host_blocks, prompts):
    # A GPU pool of 5 (the largest prompt's blocks) fills fast: victims every few ops.
    run_ops(gpu_policy, ops, host_blocks, host_policy, num_blocks=5, prompts=prompts)


def seeded_ops(seed: int) -> tuple[list, list, int]:
    """A busier two-tier workload than hypothesis' small examples reach: 80 operations,
    mostly whole requests over a pool of prompts that overflows the GPU pool, so most
    runs evict, demote and promote (hypothesis picks the seed and shrinks nothing)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 2) for _ in range(rng.randint(2, 10))] for _ in range(6)]
    ops: list = []
    for _ in range(80):
        r = rng.random()
        if r < 0.7:
            ops.append(("run", rng.randrange(6), rng.randrange(4)))
        elif r < 0.8:
            ops.append(("alloc", [rng.randint(0, 2) for _ in range(rng.randint(1, 6))], rng.randrange(4)))
        elif r < 0.88:
            ops.append(("append", rng.randrange(8), rng.randint(1, 3)))
        elif r < 0.93:
            ops.append(("fork", rng.randrange(8)))
        elif r < 0.99:
            ops.append(("free", rng.randrange(8)))
        else:
            ops.append(("reset",))
    return ops, prompts, rng.randint(1, 8)


@pytest.mark.parametrize("gpu_policy", ["lru", "unicache"])
@pytest.mark.parametrize("host_policy", policy_names())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_two_tier_seeded_workloads_keep_invariants_and_contents(gpu_policy, host_policy, seed):
    ops, prompts, host_blocks = seeded_ops(seed)
    run_ops(gpu_policy, ops, host_blocks, host_policy, num_blocks=6, prompts=prompts)


def test_seeded_workloads_do_promote():
    """The seeded workloads exercise the host tier (a guard on the generator itself)."""
    takes = demotions = 0
    for seed in range(10):
        ops, prompts, host_blocks = seeded_ops(seed)
        host = HostTier(host_blocks, build_policy("lru"))
        store = KVStore(6, BS, build_policy("lru"), host=host)
        for o in ops:
            if o[0] == "run":
                hashes = hash_token_blocks(prompts[o[1]], BS)
                try:
                    store.allocate("x", hashes, len(prompts[o[1]]), CLASSES[o[2]], 0.0)
                except OutOfBlocks:
                    continue
                store.cache_blocks("x", 0.0)
                store.free("x", 0.0)
        takes += host.stats.hit_blocks
        demotions += host.stats.demotions
    assert (takes, demotions) == (263, 726)


def test_every_required_policy_is_covered():
    assert {"lru", "radix-lru", "unicache", "opt"} <= set(policy_names())
