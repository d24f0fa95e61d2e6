"""The locality index's size bound drops the least recently used leaves, never a used root.

A prefix is only worth something whole: ``match`` stops at the first missing block, so
trimming a chain's root would zero the match of every block below it.
"""

from __future__ import annotations

from unicache.block_hash import BlockHash, hash_token_blocks
from unicache.router.index import LocalityIndex


def chain(first_token: int, n: int) -> list[BlockHash]:
    return hash_token_blocks(list(range(first_token, first_token + n)), 1)


def holdings(index: LocalityIndex, rid: str) -> list[BlockHash]:
    return list(index.holdings(rid).blocks)


def test_a_used_chain_loses_its_deepest_block_first():
    a, b = chain(100, 3), chain(200, 2)
    index = LocalityIndex(max_blocks_per_replica=5)
    index.apply_summary("r", 1, 0, a)
    assert index.match("r", a) == 3
    index.apply_events("r", 1, 1, stored=b, removed=[])
    assert index.match("r", a) == 3 and index.match("r", b) == 2
    # least recent first: a's tail, a's middle, a's root (the match refreshed the root
    # last), then b's in the same order
    assert holdings(index, "r") == [a[2], a[1], a[0], b[1], b[0]]
    c, d = chain(300, 1), chain(400, 1)
    index.apply_events("r", 1, 2, stored=c, removed=[])
    assert holdings(index, "r") == [a[1], a[0], b[1], b[0], c[0]]
    assert index.match("r", a) == 2  # was 0 when the oldest-stored block (a's root) went first
    index.apply_events("r", 1, 3, stored=d, removed=[])  # b is now the least recent chain
    assert holdings(index, "r") == [b[0], c[0], a[1], a[0], d[0]]
    assert index.match("r", b) == 1 and index.match("r", a) == 2
    assert index.num_blocks("r") == 5


def test_a_recently_matched_prefix_outlives_older_unused_blocks():
    hot, cold = chain(100, 2), chain(200, 3)
    index = LocalityIndex(max_blocks_per_replica=5)
    index.apply_summary("r", 1, 0, hot + cold)
    assert index.match("r", hot) == 2
    index.apply_events("r", 1, 1, stored=chain(300, 2), removed=[])
    # the two least recent are cold's first two blocks (stored, never matched)
    assert holdings(index, "r") == [cold[2], hot[1], hot[0], *chain(300, 2)]
    assert index.match("r", hot) == 2
    assert index.match("r", cold) == 0


def test_a_partial_match_refreshes_only_the_blocks_it_found():
    a = chain(100, 3)
    index = LocalityIndex(max_blocks_per_replica=10)
    index.apply_summary("r", 1, 0, a)
    query = a[:2] + chain(900, 2)
    assert index.match("r", query) == 2
    assert holdings(index, "r") == [a[2], a[1], a[0]]
    assert index.match("missing", a) == 0
