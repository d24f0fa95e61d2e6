"""The locality index's host-tier side: gated like GPU events, dropped with them, bounded."""

from __future__ import annotations

from unicache.block_hash import hash_id_blocks
from unicache.router.index import LocalityIndex

H = hash_id_blocks(list(range(8)))


def test_host_match_continues_a_gpu_match_and_follows_events():
    idx = LocalityIndex()
    assert idx.apply_summary("r", 1, 0, H[:2], host_hashes=H[2:4])
    assert (idx.match("r", H), idx.host_match("r", H, 2), idx.host_match("r", H, 0)) == (2, 2, 0)
    # A demotion (GPU remove + host store) and a promotion (host remove + GPU store).
    assert idx.apply_events("r", 1, 1, [H[2]], [H[1]], host_stored=[H[1]], host_removed=[H[2]])
    assert idx.host_match("r", H, 1) == 1 and idx.num_host_blocks("r") == 2
    # A gap is refused whole: the host side does not move either.
    assert not idx.apply_events("r", 1, 5, [], [], host_stored=[H[4]])
    assert idx.num_host_blocks("r") == 2
    assert idx.apply_summary("r", 1, 5, H[:1], host_hashes=())
    assert idx.num_host_blocks("r") == 0
    assert idx.apply_events("r", 1, 6, [], [], host_stored=H[1:3])
    assert idx.apply_events("r", 1, 7, [], [], cleared=True)
    assert idx.host_match("r", H, 0) == 0
    idx.apply_events_unchecked("r", [], [], host_stored=H[:3])
    idx.drop_replica("r")
    assert idx.num_host_blocks("r") == 0


def test_host_holdings_are_bounded_by_the_announced_host_capacity_oldest_first():
    idx = LocalityIndex()
    idx.set_host_capacity("r", 3)
    idx.apply_events_unchecked("r", [], [], host_stored=H[:5])
    assert [idx.host_match("r", H, i) for i in range(6)] == [0, 0, 3, 2, 1, 0]
    assert idx.num_host_blocks("r") == 3
