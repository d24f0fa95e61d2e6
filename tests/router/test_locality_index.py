"""The locality index keyed by block hash -> replicas (router/cluster/index.py): prefix walks,
per-replica stream state, bounds, and its internal invariants under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import BlockHash, hash_token_blocks
from unicache.router.cluster.index import LocalityIndex


def chain(first_token: int, n: int) -> list[BlockHash]:
    return hash_token_blocks(list(range(first_token, first_token + n)), 1)


def parents(hashes: list[BlockHash]) -> list[BlockHash | None]:
    return [None, *hashes[:-1]] if hashes else []


def synced(index: LocalityIndex, rid: str, hashes: list[BlockHash]) -> None:
    index.apply_summary(rid, 1, 0, hashes, parents(hashes))


def test_prefix_matches_names_exactly_the_replicas_that_hold_a_prefix():
    p = chain(100, 6)
    index = LocalityIndex()
    synced(index, "a", p[:2])
    synced(index, "b", p[:5])
    synced(index, "c", p)
    synced(index, "d", chain(200, 4))  # holds nothing of p
    synced(index, "e", p[1:4])  # not the first block: a chain cannot match from inside
    assert index.prefix_matches(p) == {"a": 2, "b": 5, "c": 6}
    assert index.prefix_matches(p[:3]) == {"a": 2, "b": 3, "c": 3}
    assert index.prefix_matches(chain(900, 3)) == {}
    assert index.prefix_matches([]) == {}
    assert {r: index.match(r, p) for r in "abcde"} == {"a": 2, "b": 5, "c": 6, "d": 0, "e": 0}
    assert index.holders(p[1]) == {"a", "b", "c", "e"}


def test_prefix_matches_refreshes_the_deepest_matched_entry_and_parents_inherit_it():
    p = chain(100, 3)
    index = LocalityIndex()
    synced(index, "a", p)  # tick 1
    synced(index, "b", p[:1])  # tick 2
    assert index.prefix_matches(p[:2]) == {"a": 2, "b": 1}  # tick 3
    assert [index.holdings("a").blocks[x].tick for x in p] == [1, 3, 1]
    assert index.holdings("b").blocks[p[0]].tick == 3
    index.apply_events_unchecked("a", [], [p[2]])
    index.apply_events_unchecked("a", [], [p[1]])  # p[0] becomes a leaf: p[1]'s use is its use
    assert index.holdings("a").blocks[p[0]].tick == 3


def test_drop_replica_removes_it_from_every_blocks_holders():
    p, q = chain(100, 4), chain(200, 2)
    index = LocalityIndex()
    synced(index, "a", p)
    synced(index, "b", p[:2] + q)
    index.apply_summary("b", 1, 0, p[:2] + q, [None, p[0], None, q[0]])
    assert index.num_entries() == 8 and index.num_hashes() == 6
    index.drop_replica("b")
    assert [index.holders(x) for x in p + q] == [{"a"}] * 4 + [set()] * 2
    assert index.num_entries() == 4 and index.num_hashes() == 4
    assert index.prefix_matches(p) == {"a": 4}
    assert index.replicas() == ["a"] and index.needs_resync("b")


def test_removed_and_cleared_leave_the_holder_sets():
    p = chain(100, 3)
    index = LocalityIndex()
    synced(index, "a", p)
    synced(index, "b", p)
    assert index.apply_events("a", 1, 1, stored=[], removed=[p[2]])
    assert index.prefix_matches(p) == {"a": 2, "b": 3}
    assert index.apply_events("b", 1, 1, stored=p[:1], removed=[], cleared=True, parents=[None])
    assert index.prefix_matches(p) == {"a": 2, "b": 1}
    assert index.holders(p[2]) == set() and index.num_hashes() == 2


def test_summary_replaces_a_replicas_entries():
    p, q = chain(100, 3), chain(200, 2)
    index = LocalityIndex()
    synced(index, "a", p)
    index.apply_summary("a", 2, 7, q, parents(q))
    assert index.prefix_matches(p) == {} and index.prefix_matches(q) == {"a": 2}
    h = index.holdings("a")
    assert (h.epoch, h.applied_seq, h.needs_resync, set(h.blocks)) == (2, 7, False, set(q))
    assert index.num_hashes() == 2


def test_gap_epoch_and_duplicates():
    p = chain(100, 4)
    index = LocalityIndex()
    assert index.apply_events("a", 1, 1, p[:1], []) is False  # never synced
    assert index.holdings("a").fault == "epoch"
    synced(index, "a", p[:1])
    assert index.apply_events("a", 1, 1, p[1:2], [], parents=[p[0]]) is True
    assert index.apply_events("a", 1, 1, p[2:3], [], parents=[p[1]]) is True  # duplicate seq: ignored
    assert index.match("a", p) == 2
    assert index.apply_events("a", 1, 3, p[2:3], [], parents=[p[1]]) is False
    h = index.holdings("a")
    assert (h.fault, h.needs_resync, h.applied_seq) == ("gap", True, 1)
    assert index.apply_events("a", 1, 2, p[2:3], [], parents=[p[1]]) is False  # resync pending
    synced(index, "a", p[:3])  # the resync
    assert index.apply_events("a", 2, 1, p[3:], [], parents=[p[2]]) is False
    assert index.holdings("a").fault == "epoch"
    assert index.match("a", p) == 3


def test_a_claim_over_capacity_is_trimmed_from_the_tail_and_marks_resync():
    p = chain(100, 6)
    index = LocalityIndex()
    index.set_capacity("a", 4)
    synced(index, "a", p[:2])
    assert index.apply_events("a", 1, 1, p[2:], [], parents=p[1:5]) is False
    h = index.holdings("a")
    assert (h.fault, h.needs_resync, set(h.blocks)) == ("over_capacity", True, set(p[:4]))
    assert index.apply_summary("a", 2, 0, p, parents(p)) is False
    assert set(index.holdings("a").blocks) == set(p[:4])
    assert index.apply_summary("a", 3, 0, p[:4], parents(p[:4])) is True
    assert not index.needs_resync("a")


def test_parents_must_match_the_stored_blocks():
    index = LocalityIndex()
    synced(index, "a", [])
    with pytest.raises(ValueError, match="2 parents for 1 stored blocks"):
        index.apply_events("a", 1, 1, chain(100, 1), [], parents=[None, None])


def test_a_removed_parent_does_not_make_a_later_incarnation_a_leaf_too_early():
    # a0 -> a1 indexed; a0 evicted first (policies may), then re-stored with a new child
    # b1. Removing the orphan a1 must not count against the new a0.
    a = chain(100, 2)
    b1 = hash_token_blocks([100, 900], 1)[1]
    index = LocalityIndex(max_blocks_per_replica=3)
    synced(index, "r", a)
    index.apply_events("r", 1, 1, [], [a[0]])
    index.apply_events("r", 1, 2, [a[0], b1], [], parents=[None, a[0]])
    index.apply_events("r", 1, 3, [], [a[1]])
    assert index.holdings("r").blocks[a[0]].children == 1
    c = chain(500, 2)
    index.apply_events("r", 1, 4, c, [], parents=parents(c))
    assert set(index.holdings("r").blocks) == {a[0], *c}  # b1, the LRU leaf, went first
    assert index.match("r", [a[0], b1]) == 1


def test_the_leaf_heap_stays_bounded_under_churn():
    # A chain matched over and over while its tail and a scratch block come and go: the
    # heap must not keep an item per push forever (a leak on a long-running router).
    a, x = chain(100, 50), chain(900, 1)
    index = LocalityIndex(max_blocks_per_replica=100)
    synced(index, "r", a)
    for seq in range(1, 4001):
        assert index.match("r", a) == 50 - (seq % 2 == 0)
        if seq % 2:
            index.apply_events("r", 1, seq, x, [a[-1]], parents=[None])
        else:
            index.apply_events("r", 1, seq, [a[-1]], x, parents=[a[-2]])
    h = index.holdings("r")
    assert set(h.blocks) == set(a) and len(h.leaves) <= 2 * len(h.blocks) + 64
    assert index.holdings("r").blocks[a[-2]].children == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "match", "clear", "drop", "summary", "host"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 3),  # chain id
        st.integers(1, 6),  # depth
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_hold_under_random_operations(seq):
    chains = [chain(100 * (c + 1), 6) for c in range(4)]
    index = LocalityIndex(max_blocks_per_replica=7)
    for op, rid, c, depth in seq:
        p = chains[c][:depth]
        if op == "store":
            index.apply_events_unchecked(rid, p, [], parents(p))
        elif op == "remove":
            index.apply_events_unchecked(rid, [], p[-1:])
        elif op == "match":
            got = index.prefix_matches(p)
            assert got == {r: m for r in index.replicas() if (m := index.match(r, p))}
            runs = {r: t for r in index.replicas() if (t := index.tier_run(r, chains[c], got.get(r, 0))).length}
            assert index.tier_runs(chains[c], got) == runs
        elif op == "host":
            index.apply_events_unchecked(rid, [], [], host_stored=p[-2:], host_removed=p[:1])
        elif op == "clear":
            index.apply_events_unchecked(rid, [], [], cleared=True)
        elif op == "drop":
            index.drop_replica(rid)
        else:
            index.apply_summary(rid, 1, 0, p, parents(p))
        entries = 0
        for r in index.replicas():
            blocks = index.holdings(r).blocks
            entries += len(blocks)
            assert len(blocks) <= 7
            for bh, e in blocks.items():
                assert index._holders[bh][r] is e and e.block_hash == bh
                assert e.children == sum(1 for x in blocks.values() if x.parent is e)
                # a parent that left before its child stays behind as a dead entry
                assert e.parent is None or e.parent.children == -1 or blocks.get(e.parent.block_hash) is e.parent
        assert entries == sum(len(v) for v in index._holders.values()) == index.num_entries()
        assert all(index._holders.values()) and all(index._host_holders.values())
        assert {(bh, r) for bh, rs in index._host_holders.items() for r in rs} == {
            (bh, r) for r in index.replicas() for bh in index.holdings(r).host}


def _tick_state(index: LocalityIndex) -> dict:
    return {(rid, bh): e.tick for rid in index.replicas() for bh, e in index.holdings(rid).blocks.items()}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_replicas=st.integers(1, 24), wide=st.integers(0, 24))
def test_match_groups_are_prefix_matches_split_and_touch_the_same_entries(data, n_replicas, wide):
    """``prefix_match_groups`` gives every holder of the first block its ``prefix_matches``
    length, once, in ``deep`` (at most ``wide`` of them, unless none was grouped) or in
    the group of its length, and refreshes the same entries' ticks; ``tier_runs`` given
    the groups finds every host-tier run it finds given ``prefix_matches``."""
    chain = [BlockHash(bytes([i + 1]) * 16) for i in range(12)]
    other = [BlockHash(bytes([200 + i]) * 16) for i in range(3)]
    built = []
    for _ in range(2):
        idx = LocalityIndex()
        built.append(idx)
    for r in range(n_replicas):
        held = data.draw(st.integers(0, len(chain)))
        gaps = data.draw(st.sets(st.integers(0, len(chain) - 1), max_size=2))  # out-of-order holdings
        blocks = [h for i, h in enumerate(chain[:held]) if i not in gaps] + data.draw(st.sampled_from([[], other]))
        on_host = data.draw(st.sets(st.integers(0, len(chain) - 1), max_size=4))  # demoted blocks
        for idx in built:
            idx.apply_events_unchecked(f"r{r}", blocks, [], host_stored=[chain[i] for i in on_host])
    prompt = chain[: data.draw(st.integers(1, len(chain)))] + data.draw(st.sampled_from([[], other[:1]]))
    plain, grouped = built
    expected = plain.prefix_matches(prompt)
    deep, groups = grouped.prefix_match_groups(prompt, wide)
    got = dict(deep)
    for length, ids in groups:
        assert ids and not (ids & got.keys())
        got.update(dict.fromkeys(ids, length))
    assert got == expected
    assert len(deep) <= wide or not groups
    assert [length for length, _ in groups] == sorted({length for length, _ in groups})
    assert _tick_state(plain) == _tick_state(grouped)
    assert grouped.tier_runs(prompt, deep, groups) == plain.tier_runs(prompt, expected)


def test_a_prefix_the_whole_fleet_holds_is_grouped_and_the_few_that_go_on_are_walked():
    chain = [BlockHash(bytes([i + 1]) * 16) for i in range(6)]
    idx = LocalityIndex()
    for r in range(10):
        idx.apply_events_unchecked(f"r{r}", chain[:2] if r < 7 else chain[: 3 + r - 7], [])
    # r0-r6 hold 2 blocks, r7 3, r8 4, r9 5: more than 4 replicas hold 2 blocks, 3 go on
    deep, groups = idx.prefix_match_groups(chain, wide=4)
    assert deep == {"r7": 3, "r8": 4, "r9": 5}
    assert groups == [(2, {f"r{r}" for r in range(7)})]
    assert idx.prefix_match_groups(chain, wide=10) == (idx.prefix_matches(chain), [])
