"""``KVStore.free`` releases a request's blocks in one ``on_release_many`` call; the
batch overrides (lru, unicache) must evict exactly as ``on_release`` per block does."""

from __future__ import annotations

import functools
import random

import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.request_class import SINGLE_TURN, RequestClass, Task
from unicache.replica.eviction.base import EvictionPolicy
from unicache.replica.eviction.lru import LRUPolicy
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import KVStore, OutOfBlocks
from tests.support.unicache_variants import AblationUniCache

BS = 4


def toks(*block_values: int, extra: int = 0) -> list[int]:
    """Token ids: one full block per value (all tokens equal to it), plus ``extra`` tokens."""
    return [v for v in block_values for _ in range(BS)] + [999] * extra


class RecordingLRU(LRUPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def on_release_many(self, block_ids, positions, cls, num_blocks, num_prompt_blocks, now):
        self.calls.append((list(block_ids), list(positions), num_blocks, num_prompt_blocks, now))
        super().on_release_many(block_ids, positions, cls, num_blocks, num_prompt_blocks, now)


def test_free_hands_the_policy_zero_ref_hashed_blocks_in_one_call_tail_first():
    policy = RecordingLRU()
    store = KVStore(8, BS, policy)
    for rid, tokens, now in (("a", toks(1, 2, 3, extra=2), 0.0), ("b", toks(1, 2, 7), 1.0)):
        store.allocate(rid, hash_token_blocks(tokens, BS), len(tokens), SINGLE_TURN, now)
        store.cache_blocks(rid, now)
    assert store.block_table("a") == [0, 1, 2, 3] and store.block_table("b") == [0, 1, 4]
    store.free("a", 2.0)  # 3: partial, to the free queue; 1 and 0: still held by b
    store.free("b", 3.0)
    store.allocate("c", [], 3, SINGLE_TURN, 4.0)  # nothing hashed: no policy call
    store.free("c", 5.0)
    assert policy.calls == [([2], [2], 4, 4, 2.0), ([4, 1, 0], [2, 1, 0], 3, 3, 3.0)]
    assert policy.order() == [2, 4, 1, 0]
    store.check_invariants()


# -------------------------------------------------- batch == per block
CLASSES = [
    SINGLE_TURN,
    RequestClass(session_id="s", turn=0, task=Task.CHAT),
    RequestClass(session_id="s", turn=3, task=Task.CHAT),
    RequestClass(session_id="t", turn=12, task=Task.CHAT),
    RequestClass(session_id="g", turn=2, task=Task.AGENT),
    RequestClass(template=True, template_blocks=2, task=Task.TOOL),
    RequestClass(template=True, template_blocks=5, task=Task.CODE),
]

POLICIES = {
    "lru": {},
    "unicache": {},
    "unicache-every-request": dict(update_every=1),
    "unicache-one-session-short-halflife": dict(max_sessions=1, structural_rate_halflife_s=5.0, update_every=2),
}
# The test double's variants (tests/support/unicache_variants.py) go through the same release path.
VARIANTS = {
    "variant-no-rate": dict(structural_rate=False, update_every=2),
    "variant-no-lanes": dict(tail_lane=False, turn_lanes=False, freq_lanes=False),
    "variant-arrival-gaps-one-session": dict(gap_from_release=False, max_sessions=1),
    "variant-strict-no-sessions": dict(strict_evict_first=True, session_queues=False),
    "variant-efficiency": dict(weighting="efficiency", update_every=1),
    "variant-novel-weighed-ghost-uses": dict(novel_first=False, ghost_uses=True, update_every=2),
    "variant-no-novel-lane": dict(novel_lane=False),
}


def per_block(policy: EvictionPolicy) -> EvictionPolicy:
    """The same policy, with ``on_release_many`` forced to the base class's per-block loop."""
    policy.on_release_many = functools.partial(EvictionPolicy.on_release_many, policy)  # type: ignore[method-assign]
    return policy


def replay(name: str, seed: int, batch: bool) -> tuple[list[int], list[int]]:
    """Every victim in eviction order over a seeded mixed history (sessions, templates,
    decode blocks, forks, shared prefixes, equal timestamps), then the drain order."""
    if name in VARIANTS:
        policy = AblationUniCache(**VARIANTS[name])
    else:
        policy = make_policy(name.split("-")[0], **POLICIES[name])
    if not batch:
        per_block(policy)
    victims: list[int] = []
    pop_victims = policy.pop_victims

    def recording_pop_victims(n: int) -> list[int]:
        out = pop_victims(n)
        victims.extend(out)
        return out

    policy.pop_victims = recording_pop_victims  # type: ignore[method-assign]
    store = KVStore(24, BS, policy, collect_events=False)
    rng = random.Random(seed)
    live: list[str] = []
    for i in range(600):
        now = float(i // 3)  # equal release times tie within a request and across requests
        op = rng.random()
        if op < 0.45 or not live:
            cls = rng.choice(CLASSES)
            prefix = [rng.randrange(4)] * rng.randrange(4)  # shared template/session prefixes
            tokens = toks(*prefix, *(rng.randrange(6) for _ in range(rng.randrange(1, 4))), extra=rng.randrange(BS))
            rid = f"r{i}"
            try:
                store.allocate(rid, hash_token_blocks(tokens, BS), len(tokens), cls, now)
            except OutOfBlocks:
                continue
            store.cache_blocks(rid, now)
            live.append(rid)
        elif op < 0.6:
            rid = rng.choice(live)
            try:
                store.append_tokens(rid, rng.randrange(1, 2 * BS), now)  # decode blocks
            except OutOfBlocks:
                continue
        elif op < 0.67:
            child = f"r{i}"
            store.fork(rng.choice(live), child)
            live.append(child)
        else:
            store.free(live.pop(rng.randrange(len(live))), now)
    for rid in live:
        store.free(rid, 1000.0)
    store.check_invariants()
    return victims, policy.pop_victims(len(policy))


@pytest.mark.parametrize("name", sorted(POLICIES) + sorted(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_release_evicts_exactly_as_per_block_release(name, seed):
    victims, drained = replay(name, seed, batch=True)
    assert len(victims) > 100 and drained
    assert (victims, drained) == replay(name, seed, batch=False)


@pytest.mark.parametrize("name", ["lru", "unicache"])
def test_subclass_that_changes_on_release_gets_it_per_block(name):
    seen = []

    class Spy(type(make_policy(name))):
        def on_release(self, block_id, info):
            seen.append((block_id, info.position, info.is_decode))
            super().on_release(block_id, info)

    p = Spy()
    p.on_release_many([7, 5, 3], [2, 1, 0], SINGLE_TURN, 3, 2, 1.0)
    assert seen == [(7, 2, True), (5, 1, False), (3, 0, False)]
    # unicache: 5, the last prompt block, sits in the tail lane; lru: release order.
    assert p.pop_victims(3) == ([7, 3, 5] if name == "unicache" else [7, 5, 3])


@pytest.mark.parametrize("batch", [True, False])
def test_unicache_compaction_inside_a_batch_keeps_the_per_block_order(batch):
    # Block 0 stays a candidate at the head of lane 0 while blocks 2 and 3 are released
    # into it and hit, 34 times: their stale entries pile up behind it (69 entries, 1
    # live) until the 35th release compacts the lane between block 2's push and block 3's.
    p = make_policy("unicache", update_every=1)
    if not batch:
        per_block(p)
    p.on_release_many([9, 0], [1, 0], SINGLE_TURN, 2, 2, 0.0)  # 9: tail lane; 0: lane 0
    for t in range(1, 35):
        p.on_release_many([1, 2, 3], [2, 1, 0], SINGLE_TURN, 3, 3, float(t))
        for b in (1, 2, 3):
            p.on_access(b, SINGLE_TURN, t + 0.5)
    assert len(p._heaps[0]) == 69
    p.on_release_many([1, 2, 3], [2, 1, 0], SINGLE_TURN, 3, 3, 35.0)
    assert sorted(e[2] for e in p._heaps[0]) == [0, 2, 3]
    p.on_request(SINGLE_TURN, 36.0)
    assert p.pop_victims(6) == [9, 1, 0, 2, 3]  # the tail lane (a lower reuse rate) first
