"""Exact outcomes of the KV store's host tier: demotion, promotion, events, transfers, order."""

from __future__ import annotations

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.kv_tier import Tier
from unicache.contract.request_class import SINGLE_TURN, RequestClass, Task
from unicache.replica.eviction.base import ReleaseInfo
from unicache.replica.eviction.registry import make_host_policy, make_policy
from unicache.replica.eviction.unicache.host import HostUniCachePolicy
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.store import Allocation, KVStore
from unicache.replica.kv.transfers import Transfer, TransferRun, transfer_runs

BS = 4
CHAT = RequestClass(session_id="s", turn=1, task=Task.CHAT)


def toks(*block_values: int) -> list[int]:
    return [v for v in block_values for _ in range(BS)]


def two_tier(gpu_blocks: int = 4, host_blocks: int = 4, host_policy: str = "lru") -> KVStore:
    host = HostTier(host_blocks, make_host_policy(host_policy))
    return KVStore(gpu_blocks, BS, make_policy("lru"), host=host, record_transfers=True)


def admit(store, rid, tokens, now, cls=SINGLE_TURN):
    hashes = hash_token_blocks(tokens, BS)
    alloc = store.allocate(rid, hashes, len(tokens), cls, now)
    store.cache_blocks(rid, now)
    return alloc, hashes


def test_victims_are_demoted_and_a_match_promotes_them():
    store = two_tier()
    _, ha = admit(store, "a", toks(1, 2), 0.0)
    store.free("a", 1.0)
    _, hb = admit(store, "b", toks(3, 4), 1.0)
    store.free("b", 2.0)
    store.take_events()
    c, hc = admit(store, "c", toks(5, 6, 7), 2.0)
    # LRU victims 1, 0, 3 (a's tail, a's head, b's tail) go to host slots 0, 1, 2.
    assert c.block_ids == (1, 0, 3)
    assert store.take_transfers() == [Transfer(Tier.HOST, 1, 0), Transfer(Tier.HOST, 0, 1), Transfer(Tier.HOST, 3, 2)]
    assert sorted(store.host_hashes()) == sorted([ha[1], ha[0], hb[1]])
    assert store.match_tiers(ha) == (0, 2)
    store.free("c", 3.0)
    store.take_events()

    a2, _ = admit(store, "a2", toks(1, 2), 3.0)
    # Two host hits promoted into GPU victims 2 (b's head) and 3 (c's last block); those
    # are demoted first: b's head to free slot 3, c's block by evicting b's tail (the
    # host LRU's oldest unpinned block) from slot 2.
    assert a2 == Allocation((2, 3), 2, 8, 2)
    assert store.take_transfers() == [
        Transfer(Tier.HOST, 2, 3),
        Transfer(Tier.HOST, 3, 2),
        Transfer(Tier.GPU, 2, 1),
        Transfer(Tier.GPU, 3, 0),
    ]
    assert store.take_events() == [
        BlockRemoved(hb[0], 3.0),
        BlockStored(hb[0], None, 3.0, Tier.HOST),
        BlockRemoved(hc[2], 3.0),
        BlockRemoved(hb[1], 3.0, Tier.HOST),
        BlockStored(hc[2], hc[1], 3.0, Tier.HOST),
        BlockRemoved(ha[0], 3.0, Tier.HOST),
        BlockStored(ha[0], None, 3.0),
        BlockRemoved(ha[1], 3.0, Tier.HOST),
        BlockStored(ha[1], ha[0], 3.0),
    ]
    assert (store.stats.hit_blocks, store.stats.evictions) == (0, 5)
    h = store.host.stats
    assert (h.hit_blocks, h.demotions, h.evictions, h.dropped_demotions) == (2, 5, 1, 0)
    assert store.match_tiers(ha) == (2, 0)
    store.check_invariants()


def test_transfer_runs_batch_one_direction_and_keep_the_last_write():
    runs = transfer_runs([
        Transfer(Tier.HOST, 2, 3),
        Transfer(Tier.HOST, 5, 3),
        Transfer(Tier.HOST, 3, 2),
        Transfer(Tier.GPU, 2, 1),
        Transfer(Tier.HOST, 2, 1),
    ])
    assert runs == [
        TransferRun(Tier.HOST, (5, 3), (3, 2)),
        TransferRun(Tier.GPU, (1,), (2,)),
        TransferRun(Tier.HOST, (2,), (1,)),
    ]


def _info(cls, now, is_decode=False):
    return ReleaseInfo(cls, 0, 1, is_decode, now)


def test_host_unicache_evicts_the_earliest_demoted_block_as_lru_does():
    """A session block demoted first leaves before a later one-off block under both:
    the host keeps the GPU's ranking (HostUniCachePolicy), the class does not reorder."""
    victims = {}
    for name in ("unicache", "lru"):
        tier = HostTier(2, make_host_policy(name))
        tier.put(b"session", None, _info(CHAT, 1.0), 1.0)
        tier.put(b"one-off", None, _info(SINGLE_TURN, 0.5, is_decode=True), 2.0)
        slot, evicted = tier.put(b"new", None, _info(SINGLE_TURN, 3.0), 3.0)
        victims[name] = (slot, evicted)
        tier.check_invariants()
    assert victims == {"unicache": (0, b"session"), "lru": (0, b"session")}


def test_a_demotion_finding_every_slot_pinned_is_dropped():
    tier = HostTier(1, make_policy("lru"))
    assert tier.put(b"x", None, _info(SINGLE_TURN, 1.0), 1.0) == (0, None)
    assert tier.take(b"x", SINGLE_TURN, 2.0) == 0
    assert tier.put(b"y", None, _info(SINGLE_TURN, 2.0), 2.0) == (None, None)
    assert tier.stats.dropped_demotions == 1 and len(tier) == 0
    tier.release([0])
    assert tier.put(b"y", None, _info(SINGLE_TURN, 3.0), 3.0) == (0, None)
    tier.check_invariants()


def test_a_hash_recomputed_on_the_gpu_leaves_the_host_tier():
    store = two_tier()
    ha = hash_token_blocks(toks(1, 2), BS)
    # The host holds a's second block but not its first: the chain is broken, no hit.
    store.host.put(ha[1], ha[0], _info(SINGLE_TURN, 0.0), 0.0)
    alloc, _ = admit(store, "a", toks(1, 2), 1.0)
    assert alloc == Allocation((0, 1), 0, 0, 0)
    assert store.take_events() == [
        BlockStored(ha[0], None, 1.0),
        BlockRemoved(ha[1], 1.0, Tier.HOST),
        BlockStored(ha[1], ha[0], 1.0),
    ]
    assert store.host_hashes() == []
    store.check_invariants()


def test_reset_empties_both_tiers():
    store = two_tier(gpu_blocks=2)
    _, ha = admit(store, "a", toks(1, 2), 0.0)
    store.free("a", 1.0)
    _, hb = admit(store, "b", toks(3), 1.0)  # demotes a's tail
    store.free("b", 2.0)
    store.take_events()
    assert store.reset_cache(3.0) == 2
    assert store.take_events() == [
        BlockRemoved(ha[0], 3.0),
        BlockRemoved(hb[0], 3.0),
        BlockRemoved(ha[1], 3.0, Tier.HOST),
        AllBlocksCleared(3.0),
    ]
    assert store.match_tiers(ha) == (0, 0)
    store.check_invariants()


def test_host_hits_stop_where_the_request_needs_no_more_blocks():
    store = two_tier(gpu_blocks=2)
    admit(store, "a", toks(1, 2), 0.0)
    store.free("a", 1.0)
    admit(store, "x", toks(8, 9), 1.0)  # both of a's blocks go to the host
    store.free("x", 2.0)
    ha = hash_token_blocks(toks(1, 2), BS)
    # A request holding one block's worth of tokens promotes only the first block.
    alloc = store.allocate("a1", ha, BS, SINGLE_TURN, 2.0)
    assert (alloc.num_hit_blocks, alloc.num_host_hit_blocks) == (1, 1)
    assert store.match_tiers(ha) == (1, 1)
    store.check_invariants()


class RecordingLRU(type(make_policy("lru"))):
    """lru that records the parent id each demoted block joins with."""

    def __init__(self):
        super().__init__()
        self.parents: list[tuple[int, int]] = []

    def on_cached(self, block_id, block_hash, parent_id, now):
        self.parents.append((block_id, parent_id))


def test_a_demoted_block_names_its_parent_in_the_host_policy_terms():
    """Parent in the host tier: its slot; parent cached on the GPU: ``outside_parent``
    (not the root); a first block: -1."""
    host = HostTier(4, RecordingLRU())
    store = KVStore(3, BS, make_policy("lru"), host=host)
    admit(store, "a", toks(1, 2, 3), 0.0)
    store.free("a", 1.0)  # candidates tail first: blocks 2, 1, 0
    admit(store, "x", toks(9), 1.0)  # demotes a's block 2 (parent block 1 still on the GPU)
    store.free("x", 2.0)
    admit(store, "y", toks(8, 7), 2.0)  # demotes a's block 1 (parent block 0 on the GPU) and 0
    assert host.outside_parent == 4
    assert host.policy.parents == [(0, 4), (1, 4), (2, -1)]
    store.check_invariants()



def _head_on_host() -> tuple[KVStore, list, list]:
    """A 3-block FIFO GPU tier whose victim was a chain's head while its tail stays.

    FIFO keeps a block's first release place: "a" releases h1 first, "b" extends it to
    h1 h2 h3, so h1 leaves first, to host slot 0, when "x" needs a block (x holds it)."""
    host = HostTier(4, make_policy("lru"))
    store = KVStore(3, BS, make_policy("fifo"), host=host, record_transfers=True)
    admit(store, "a", toks(1), 0.0)
    store.free("a", 0.5)
    _, hb = admit(store, "b", toks(1, 2, 3), 1.0)
    store.free("b", 1.5)
    _, hx = admit(store, "x", toks(9), 2.0)
    return store, hb, hx


def test_a_match_runs_on_through_gpu_blocks_past_a_promoted_parent():
    """The next match promotes the head and shares the tail (it used to stop at the first
    GPU block past the host ones, evict that tail and recompute it)."""
    store, hb, hx = _head_on_host()
    store.free("x", 2.5)
    assert store.take_transfers() == [Transfer(Tier.HOST, 0, 0)]
    assert store.match_tiers(hb) == (2, 1)
    store.take_events()
    alloc = store.allocate("b2", hb, 3 * BS, SINGLE_TURN, 3.0)
    # b's tail blocks 1 and 2 are shared; x's block 0 is the one victim (to slot 1) and
    # takes the head back from slot 0.
    assert alloc == Allocation((0, 1, 2), 3, 12, 1)
    assert store.take_transfers() == [Transfer(Tier.HOST, 0, 1), Transfer(Tier.GPU, 0, 0)]
    assert store.take_events() == [
        BlockRemoved(hx[0], 3.0),
        BlockStored(hx[0], None, 3.0, Tier.HOST),
        BlockRemoved(hb[0], 3.0, Tier.HOST),
        BlockStored(hb[0], None, 3.0),
    ]
    assert (store.stats.hit_blocks, store.host.stats.hit_blocks) == (1 + 2, 1)
    assert store.match_tiers(hb) == (3, 0)
    assert store.host_hashes() == [hx[0]]
    store.check_invariants()


def test_admission_counts_the_gpu_blocks_inside_the_tier_run_as_shared():
    """``can_allocate`` plans as ``allocate`` does: with the chain's tail shared, one new
    block is enough; without the host copy of the head, three are needed."""
    store, hb, _ = _head_on_host()
    # Free now: b's two tail blocks only. Sharing them leaves none to take, but the
    # request needs one new block for the head it promotes.
    assert not store.can_allocate(hb, 3 * BS)
    store.free("x", 2.5)
    assert store.can_allocate(hb, 3 * BS)
    store.host.discard(hb[0])
    assert store.can_allocate(hb, 3 * BS)  # three candidates for three new blocks
    assert not store.can_allocate(hb + [b"z"], 4 * BS)
    store.check_invariants()


TEMPLATED = RequestClass(template=True, template_blocks=2)
AGENT = RequestClass(session_id="g", turn=3, task=Task.AGENT)


def test_host_unicache_evicts_in_demotion_order_kept_per_queue():
    """``--host-eviction-policy unicache`` builds HostUniCachePolicy: victims leave in the
    order the GPU demoted them, whatever their queue or release time; each waits in its
    class's queue (counted per queue); a hit takes a block out."""
    policy = make_host_policy("unicache")
    assert isinstance(policy, HostUniCachePolicy) and policy.name == "unicache"
    releases = [
        (0, ReleaseInfo(CHAT, 0, 2, False, 5.0)),
        (1, ReleaseInfo(SINGLE_TURN, 0, 2, False, 1.0)),
        (2, ReleaseInfo(TEMPLATED, 1, 3, False, 9.0)),
        (3, ReleaseInfo(SINGLE_TURN, 2, 3, True, 2.0)),
        (4, ReleaseInfo(AGENT, 0, 1, False, 0.0)),
        (5, ReleaseInfo(TEMPLATED, 2, 3, False, 9.0)),  # past the template: evict-first
    ]
    for block_id, info in releases:
        policy.on_cached(block_id, bytes([block_id]), -1, 10.0)
        policy.on_release(block_id, info)
    assert policy.order() == [0, 1, 2, 3, 4, 5]
    assert policy.queue_sizes() == {"evict_first": 3, "chat": 1, "agent": 1, "structural": 1}
    policy.on_access(3, SINGLE_TURN, 11.0)
    policy.on_removed(3)
    policy.on_removed(0)
    assert [policy.pop_victim() for _ in range(5)] == [1, 2, 4, 5, None]
    counters = policy.queue_counters()
    assert counters.evictions == {"evict_first": 2, "chat": 0, "agent": 1, "structural": 1}
    assert counters.hits == {"evict_first": 1, "chat": 0, "agent": 0, "structural": 0}
    assert len(policy) == 0


def test_host_policies_other_than_unicache_are_the_gpu_classes():
    assert type(make_host_policy("lru")) is type(make_policy("lru"))
    assert type(make_host_policy("arc")) is type(make_policy("arc"))
