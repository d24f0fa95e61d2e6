"""``PoolCandidates``: the cached free blocks the vLLM plug-in and the simulator's vLLM pool
both hand to a policy (no vLLM needed): what the policy is told, and when."""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import SINGLE_TURN
from unicache.replica.eviction.pool_candidates import PoolCandidates

from tests.support.recording_policy import RecordingLRU

H1, H2 = BlockHash(b"\x01" * 16), BlockHash(b"\x02" * 16)


def released(policy: RecordingLRU, *ids: int) -> PoolCandidates:
    cands = PoolCandidates(policy, 8)
    for i, b in enumerate(ids):
        cands.tell_cached(b, BlockHash(bytes([b]) * 16), ids[i - 1] if i else -1, 0.0)
    cands.release_many(list(reversed(ids)), list(range(len(ids) - 1, -1, -1)), SINGLE_TURN, len(ids), len(ids), 1.0)
    return cands


def test_the_policy_hears_a_block_once_per_hash_and_a_removal_before_a_new_hash():
    policy = RecordingLRU()
    cands = PoolCandidates(policy, 4)
    cands.tell_cached(1, H1, -1, 0.0)
    cands.tell_cached(1, H1, -1, 0.0)
    cands.tell_cached(1, H2, -1, 0.0)
    assert policy.calls == [("cached", 1, -1), ("removed", 1), ("cached", 1, -1)]
    assert cands.told(1) == H2


def test_victims_come_in_the_policys_order_and_stop_being_candidates():
    policy = RecordingLRU()
    cands = released(policy, 1, 2, 3)  # released tail first: 3, 2, 1
    assert len(cands) == 3 and all(cands.is_candidate(b) for b in (1, 2, 3))
    assert cands.evict(2) == [3, 2]
    assert (cands.is_candidate(3), cands.is_candidate(2), cands.is_candidate(1)) == (False, False, True)
    assert cands.told(3) is None and cands.told(1) is not None
    assert cands.evictions == 2 and len(cands) == 1


def test_a_hit_takes_a_candidate_back_and_leaves_other_blocks_to_the_caller():
    policy = RecordingLRU()
    cands = released(policy, 1, 2)
    assert cands.take_back(2, SINGLE_TURN, 2.0) is True
    assert cands.take_back(5, SINGLE_TURN, 2.0) is False  # never released: the caller's uncached list
    assert policy.calls[-1] == ("access", 2, SINGLE_TURN)
    assert cands.evict(1) == [1]


def test_a_policy_that_names_a_block_in_use_is_an_error():
    policy = RecordingLRU()
    cands = released(policy, 1)
    cands._candidate[1] = 0  # the pool lost track: the policy still holds it
    with pytest.raises(RuntimeError, match="block 1, which is not free"):
        cands.evict(1)


def test_too_few_victims_is_an_error():
    cands = released(RecordingLRU(), 1)
    with pytest.raises(RuntimeError, match="gave 1 victims, 2 needed"):
        cands.evict(2)


def test_dropping_every_hash_empties_the_policy():
    policy = RecordingLRU()
    cands = released(policy, 1, 2, 4)
    assert cands.drop_all() == [1, 2, 4]
    assert len(cands) == 0 and cands.told(1) is None
    assert [c for c in policy.calls if c[0] == "removed"] == [("removed", 1), ("removed", 2), ("removed", 4)]
