"""``hash_token_blocks`` (one pass over the prompt) equals chaining ``hash_block`` block by
block, the definition; and the hashes themselves stay what they were (pinned values, as
computed before the one-pass version: replicas, routers and stored state must agree)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import ROOT_HASH, block_extra_keys, hash_block, hash_token_blocks


def chained(token_ids, block_size, cache_salt=None, adapter_id=None, parent=ROOT_HASH, start_index=0):
    out = []
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size],
                            block_extra_keys(start_index + i, cache_salt, adapter_id))
        out.append(parent)
    return out


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 33),
    salt=st.one_of(st.none(), st.binary(min_size=1, max_size=16)),
    adapter=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    parent=st.binary(min_size=16, max_size=16),
    start=st.integers(0, 3),
)
def test_one_pass_equals_the_chained_definition(ids, block_size, salt, adapter, parent, start):
    assert hash_token_blocks(ids, block_size, salt, adapter, parent, start) == chained(ids, block_size, salt, adapter, parent, start)


def test_hashes_are_pinned():
    assert [h.hex() for h in hash_token_blocks(list(range(40)), 16)] == [
        "16d310809c3605d60b49a1755bdbc8b2", "f5d6d115dc50f02d9a2cecb9b5456d8b"]
    assert [h.hex() for h in hash_token_blocks(list(range(40)), 16, cache_salt=b"salt", adapter_id="lora")] == [
        "f860ef4655a73df57f481a72b7baa279", "cfb1896f0226b9e7dc57d6dabe163ccd"]


def test_bad_input_is_refused_as_before():
    with pytest.raises(ValueError):
        hash_token_blocks([1, 2], 0)
    with pytest.raises(OverflowError):
        hash_token_blocks([1, -1], 2)
    assert hash_token_blocks([1, 2, 3], 4) == []
    assert hash_token_blocks([1, 2, -3], 2) == chained([1, 2], 2)  # a partial block is never read
