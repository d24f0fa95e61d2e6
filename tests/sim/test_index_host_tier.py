"""The locality index's host-tier side: gated like GPU events, dropped with them, bounded."""

from __future__ import annotations

from unicache.contract.block_hash import hash_id_blocks
from unicache.router.cluster.index import LocalityIndex

H = hash_id_blocks(list(range(8)))


def test_host_match_continues_a_gpu_match_and_follows_events():
    idx = LocalityIndex()
    assert idx.apply_summary("r", 1, 0, H[:2], host_hashes=H[2:4])
    assert (idx.match("r", H), idx.tier_run("r", H, 2), idx.tier_run("r", H, 0)) == (2, (2, ()), (0, ()))
    # A demotion (GPU remove + host store) and a promotion (host remove + GPU store).
    assert idx.apply_events("r", 1, 1, [H[2]], [H[1]], host_stored=[H[1]], host_removed=[H[2]])
    # GPU H0 H2, host H1 H3: past the GPU prefix H1 (host), H2 (GPU), H3 (host)
    assert idx.tier_run("r", H, 1) == (3, (2,)) and idx.num_host_blocks("r") == 2
    # A gap is refused whole: the host side does not move either.
    assert not idx.apply_events("r", 1, 5, [], [], host_stored=[H[4]])
    assert idx.num_host_blocks("r") == 2
    assert idx.apply_summary("r", 1, 5, H[:1], host_hashes=())
    assert idx.num_host_blocks("r") == 0
    assert idx.apply_events("r", 1, 6, [], [], host_stored=H[1:3])
    assert idx.apply_events("r", 1, 7, [], [], cleared=True)
    assert idx.tier_run("r", H, 0) == (0, ())
    idx.apply_events_unchecked("r", [], [], host_stored=H[:3])
    idx.drop_replica("r")
    assert idx.num_host_blocks("r") == 0


def test_host_holdings_are_bounded_by_the_announced_host_capacity_oldest_first():
    idx = LocalityIndex()
    idx.set_host_capacity("r", 3)
    idx.apply_events_unchecked("r", [], [], host_stored=H[:5])
    assert [idx.tier_run("r", H, i).length for i in range(6)] == [0, 0, 3, 2, 1, 0]
    assert idx.num_host_blocks("r") == 3


def test_the_tier_run_resumes_on_the_gpu_after_host_blocks_as_the_store_matches():
    """GPU 0-1, host 2-3, GPU 4 (its parent 3 was demoted first), host 5, then nothing:
    the run past the GPU prefix is 2-5 with position 4 on the GPU, as ``KVStore``'s
    ``match_tiers`` counts it; a GPU block cannot start a run, and a replica whose host
    tier lacks the block after its GPU match has no run."""
    idx = LocalityIndex()
    assert idx.apply_summary("r", 1, 0, [H[0], H[1], H[4]], host_hashes=[H[2], H[3], H[5]])
    assert idx.apply_summary("s", 1, 0, [H[0], H[1], H[2]], host_hashes=[H[4]])
    gpu = idx.prefix_matches(H)
    assert gpu == {"r": 2, "s": 3}
    assert idx.tier_run("r", H, 2) == (4, (4,)) and idx.tier_run("r", H, 2).host_blocks == 3
    assert idx.tier_run("r", H, 4) == (0, ())  # H[4] is on the GPU: no run starts there
    assert idx.tier_runs(H, gpu) == {"r": (4, (4,))}  # s: H[3] is in neither tier
    assert idx.tier_runs(H[:5], gpu) == {"r": (3, (4,))}  # the prompt ends the run


def test_the_index_fed_by_a_two_tier_store_matches_what_the_store_would_use():
    """Random sessions through a two-tier store whose GPU policy (unicache) may evict a
    parent and keep its child; the index fed by the store's events (the simulator's
    pump) must give, for every chain, the store's own ``match_tiers``: GPU prefix plus the
    run's GPU blocks, and the run's host blocks."""
    import random

    from unicache.contract.block_hash import hash_token_blocks
    from unicache.replica.eviction.registry import make_host_policy, make_policy
    from unicache.replica.kv.host_tier import HostTier
    from unicache.replica.kv.store import KVStore, OutOfBlocks
    from unicache.contract.request_class import RequestClass, Task
    from unicache.sim.replay import _pump

    bs = 4
    rng = random.Random(7)
    store = KVStore(24, bs, make_policy("unicache"), host=HostTier(12, make_host_policy("unicache")))
    index = LocalityIndex()
    prompts = {s: [1000 * s + i for i in range(bs * 3)] for s in range(8)}  # per session
    alternating = 0
    for step in range(400):
        s = rng.randrange(8)
        prompts[s] += [rng.randrange(10**6) for _ in range(bs * rng.randint(1, 3))]
        tokens = prompts[s][: bs * 12]
        cls = RequestClass(session_id=f"s{s}", turn=step, task=Task.CHAT)
        try:
            store.allocate(f"q{step}", hash_token_blocks(tokens, bs), len(tokens), cls, float(step))
        except OutOfBlocks:
            continue
        store.cache_blocks(f"q{step}", float(step))
        store.free(f"q{step}", step + 0.5)
        _pump(index, "r", store.take_events())
        for toks in prompts.values():
            h = hash_token_blocks(toks[: bs * 12], bs)
            gpu = index.prefix_matches(h).get("r", 0)
            run = index.tier_run("r", h, gpu)
            alternating += bool(run.gpu_at)
            assert store.match_tiers(h) == (gpu + len(run.gpu_at), run.host_blocks)
    assert alternating > 0  # the case the run exists for did happen
