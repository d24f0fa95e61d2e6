"""The locality index's size bounds drop the least recently used *leaves*, never a root
that still has an indexed child.

A prefix is only worth something whole: ``match`` stops at the first missing block, so
trimming a chain's root would zero the match of every block below it. Stored events
carry each block's parent (``KVEventBatch.stored_parents``), so the index knows the chains.
"""

from __future__ import annotations

from unicache.contract.block_hash import BlockHash, hash_token_blocks
from unicache.router.cluster.index import LocalityIndex


def chain(first_token: int, n: int) -> list[BlockHash]:
    return hash_token_blocks(list(range(first_token, first_token + n)), 1)


def parents(hashes: list[BlockHash]) -> list[BlockHash | None]:
    return [None, *hashes[:-1]]


def held(index: LocalityIndex, rid: str) -> set[BlockHash]:
    return set(index.holdings(rid).blocks)


def test_a_never_matched_chain_keeps_its_root_and_loses_its_tail():
    # The defect: trimming in stored order dropped a0, a1 and kept a2..a4, which no
    # request can ever match (match stops at the missing root).
    a = chain(100, 5)
    index = LocalityIndex(max_blocks_per_replica=3)
    index.apply_summary("r", 1, 0, [])
    assert index.apply_events("r", 1, 1, stored=a, removed=[], parents=parents(a))
    assert held(index, "r") == set(a[:3])
    assert index.match("r", a) == 3


def test_an_old_sender_without_parents_still_loses_the_tail_of_a_chain_stored_root_first():
    a = chain(100, 5)
    index = LocalityIndex(max_blocks_per_replica=3)
    index.apply_summary("r", 1, 0, [])
    index.apply_events("r", 1, 1, stored=a, removed=[])  # parents=None: every block a root
    assert held(index, "r") == set(a[:3])
    assert index.match("r", a) == 3


def test_a_used_chain_loses_its_deepest_block_first():
    a, b = chain(100, 3), chain(200, 2)
    index = LocalityIndex(max_blocks_per_replica=5)
    index.apply_summary("r", 1, 0, a, parents(a))
    assert index.match("r", a) == 3
    index.apply_events("r", 1, 1, stored=b, removed=[], parents=parents(b))
    assert index.match("r", a) == 3 and index.match("r", b) == 2  # b is now the more recent
    c, d = chain(300, 1), chain(400, 1)
    index.apply_events("r", 1, 2, stored=c, removed=[], parents=[None])
    assert held(index, "r") == {a[0], a[1], b[0], b[1], c[0]}  # a's leaf was the least recent
    assert index.match("r", a) == 2
    index.apply_events("r", 1, 3, stored=d, removed=[], parents=[None])  # b is now the least recent chain
    assert held(index, "r") == {a[0], a[1], b[0], c[0], d[0]}
    assert index.match("r", b) == 1 and index.match("r", a) == 2
    assert index.num_blocks("r") == 5


def test_a_recently_matched_prefix_outlives_older_unused_blocks():
    hot, cold = chain(100, 2), chain(200, 3)
    index = LocalityIndex(max_blocks_per_replica=5)
    index.apply_summary("r", 1, 0, hot + cold, parents(hot) + parents(cold))
    assert index.match("r", hot) == 2
    new = chain(300, 2)
    index.apply_events("r", 1, 1, stored=new, removed=[], parents=parents(new))
    # cold's two deepest blocks go (leaf first: cold[2], then cold[1] became the leaf)
    assert held(index, "r") == {hot[0], hot[1], cold[0], new[0], new[1]}
    assert index.match("r", hot) == 2
    assert index.match("r", cold) == 1


def test_a_parent_with_a_live_child_is_not_a_leaf():
    root = chain(100, 1)
    left = hash_token_blocks(list(range(100, 103)), 1)[1:]  # root -> l1 -> l2
    right = hash_token_blocks([100, 900], 1)[1:]  # root -> r1
    assert hash_token_blocks([100], 1) == root
    index = LocalityIndex(max_blocks_per_replica=4)
    index.apply_summary("r", 1, 0, root + left + right, [None, root[0], left[0], root[0]])
    assert index.match("r", root + right) == 2  # the right branch is more recent
    extra = chain(500, 1)
    index.apply_events("r", 1, 1, stored=extra, removed=[], parents=[None])
    assert held(index, "r") == {root[0], left[0], right[0], extra[0]}  # l2, the LRU leaf
    index.apply_events("r", 1, 2, stored=chain(600, 1), removed=[], parents=[None])
    assert held(index, "r") == {root[0], right[0], extra[0], chain(600, 1)[0]}  # then l1
    assert index.match("r", root + right) == 2


def test_a_partial_match_refreshes_only_the_blocks_it_found():
    a = chain(100, 3)
    index = LocalityIndex(max_blocks_per_replica=10)
    index.apply_summary("r", 1, 0, a, parents(a))
    query = a[:2] + chain(900, 2)
    assert index.match("r", query) == 2
    assert index.match("missing", a) == 0
    assert [index.holdings("r").blocks[x].tick for x in a] == [1, 2, 1]  # the deepest found
