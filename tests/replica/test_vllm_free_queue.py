"""``PolicyFreeQueue`` on vLLM's own block objects (no engine): vLLM's free-queue interface,
victim order from our policy, what the policy is told, and the pinned vLLM version."""

from __future__ import annotations

import pytest
from vllm.v1.core.kv_cache_utils import BlockHash as VBlockHash
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

from unicache.contract.request_class import RequestClass, Task
from unicache.replica.engines.vllm import version
from unicache.replica.engines.vllm.free_queue import PolicyFreeQueue
from unicache.replica.eviction.lru import LRUPolicy

from tests.support.recording_policy import RecordingLRU

CHAT = RequestClass(tenant="t", session_id="s1", turn=0, task=Task.CHAT)


def make_queue(n: int = 9):
    blocks = [KVCacheBlock(i) for i in range(n)]
    policy = RecordingLRU()
    # Block 0 is vLLM's null block: never in the free queue.
    return blocks, policy, PolicyFreeQueue(blocks[1:], n, policy, clock=lambda: 1.0)


def cache(blocks: list[KVCacheBlock], tag: bytes) -> None:
    for i, b in enumerate(blocks):
        b.set_block_hash(make_block_hash_with_group_id(VBlockHash(tag + bytes([i])), 0))


def run_request(queue: PolicyFreeQueue, table: list[KVCacheBlock], tag: bytes, cls: RequestClass) -> None:
    """What vLLM does for one request: cache its full blocks, then free them tail first."""
    cache(table, tag)
    queue.note_cached(table, 0, len(table))
    queue.note_release(table, cls, num_prompt_blocks=len(table))
    for b in table:
        b.ref_cnt = 0
    queue.append_n(list(reversed(table)))


def test_uncached_blocks_go_first_then_the_policy_orders_victims():
    blocks, policy, q = make_queue()
    assert q.num_free_blocks == 8
    table = q.popleft_n(3)
    assert [b.block_id for b in table] == [1, 2, 3]
    run_request(q, table, b"a", CHAT)
    assert policy.calls == [
        ("cached", 1, -1), ("cached", 2, 1), ("cached", 3, 2),
        ("release", [3, 2, 1], [2, 1, 0], CHAT, 3, 3),
    ]
    assert q.num_free_blocks == 8 and len(policy) == 3
    # Five never-cached blocks first, then LRU's victims: the request's tail first.
    assert [b.block_id for b in q.popleft_n(7)] == [4, 5, 6, 7, 8, 3, 2]
    assert q.evictions == 2 and q.num_free_blocks == 1
    with pytest.raises(ValueError):
        q.popleft_n(2)


def test_a_hit_takes_the_block_out_of_the_policy_with_the_accessing_class():
    blocks, policy, q = make_queue()
    table = q.popleft_n(2)
    run_request(q, table, b"a", CHAT)
    other = RequestClass(tenant="t", task=Task.QA)
    q.access_cls = other
    q.remove(blocks[1])
    assert policy.calls[-1] == ("access", 1, other)
    assert q.num_free_blocks == 7 and policy.order() == [2]
    # An uncached free block can be removed too (vLLM's own list handles it).
    q.remove(blocks[5])
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 4, 6, 7, 8, 2]


def test_prepend_puts_uncached_blocks_first_and_reset_empties_the_policy():
    blocks, policy, q = make_queue()
    table = q.popleft_n(3)
    run_request(q, table[:2], b"a", CHAT)
    table[2].ref_cnt = 0
    q.prepend_n([table[2]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 4, 5, 6, 7, 8, 1, 2]
    for b in blocks:
        b.reset_hash()  # what vLLM's reset_prefix_cache does to every block
    q.on_reset()
    assert sorted(c for c in policy.calls if c[0] == "removed") == [("removed", 1), ("removed", 2)]
    assert len(policy) == 0 and q.num_free_blocks == 8 and q.evictions == 0


def test_install_refuses_a_pool_that_already_caches():
    blocks = [KVCacheBlock(i) for i in range(3)]
    cache(blocks[1:2], b"x")
    with pytest.raises(ValueError, match="while no block is cached"):
        PolicyFreeQueue(blocks[1:], 3, LRUPolicy())


def test_the_installed_vllm_is_the_pinned_release():
    # Fails loudly (never skips) when another vLLM is installed: the hooks use its internals.
    assert version.check_vllm_version().split("+")[0] == version.VLLM_VERSION == "0.32.0"


def test_another_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.31.1")
    with pytest.raises(version.VLLMVersionError, match=r"vLLM 0.31.1 is installed; .* 0.32.0 exactly"):
        version.check_vllm_version()
    monkeypatch.setattr(version, "installed_vllm_version", lambda: None)
    with pytest.raises(version.VLLMVersionError, match=r"pip install 'unicache-serving\[vllm\]'"):
        version.check_vllm_version()
