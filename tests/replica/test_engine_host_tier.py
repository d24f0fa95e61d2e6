"""The built-in engine's host tier: promoted prefixes generate exactly what a cold engine
does, the copies are real (host tensors), and the cache state shows both tiers."""

from __future__ import annotations

import pytest
import torch

from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.serving.convert import cache_state_to_proto
from tests.support.engine_factory import make_request, run_one, tiny_config


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 17) % 256 for i in range(n)]


def cold(req):
    return run_one(LLMEngine(tiny_config(enable_prefix_caching=False)), req)


@pytest.mark.parametrize("host_policy", ["unicache", "lru"])
def test_promoted_prefix_generates_the_cold_tokens(host_policy):
    # 16 GPU blocks of 4 tokens. A (37 prompt + 8 output) leaves 11 full blocks cached
    # and 5 free; B (a 37-token stranger) takes 10 blocks for its prompt and 1 as it
    # decodes, evicting A's 6 tail blocks (LRU, tail first) to the host. A again: GPU hits
    # A's blocks 0-4, the host promotes 5-8 (a 37-token prompt reuses at most 9 blocks:
    # the last token is computed).
    eng = LLMEngine(tiny_config(num_blocks=16, host_blocks=32, host_eviction_policy=host_policy))
    a = prompt(1, 37)
    run_one(eng, make_request("a", a))
    run_one(eng, make_request("b", prompt(2, 37)))
    assert eng.store.host.stats.demotions == 6
    again = run_one(eng, make_request("a2", a))
    assert again.last[0].usage.cached_tokens == 36
    assert (eng.store.stats.hit_blocks, eng.store.host.stats.hit_blocks) == (5, 4)
    assert again.tokens == cold(make_request("a2", a)).tokens
    state = eng.cache_state()
    assert state.host is not None
    assert (state.host.capacity_blocks, state.host.promotions, state.host.demotions,
            state.host.eviction_policy) == (32, 4, eng.store.host.stats.demotions, host_policy)
    assert state.host.used_blocks == len(eng.store.host_hashes())
    msg = cache_state_to_proto(state, "r0")  # GetCacheState and the heartbeat carry it
    assert msg.HasField("host") and (msg.host.capacity_blocks, msg.host.promotions, msg.host.eviction_policy) == (
        32, 4, host_policy)
    assert not cache_state_to_proto(LLMEngine(tiny_config()).cache_state(), "r1").HasField("host")
    assert eng.num_referenced_blocks() == 0
    eng.check_invariants()


def test_promotion_copies_bytes_from_the_host_tensors():
    """Wiping the host tensors after the demotion makes the promoted prefix wrong: the
    forward pass reads what was copied back, never the evicted GPU block."""
    eng = LLMEngine(tiny_config(num_blocks=16, host_blocks=32))
    a = prompt(1, 37)
    first = run_one(eng, make_request("a", a, max_tokens=1)).last[0]
    run_one(eng, make_request("b", prompt(2, 37)))
    assert eng.storage.host_k is not None and eng.storage.host_k.device.type == "cpu"
    eng.storage.host_k.zero_()
    eng.storage.host_v.zero_()
    again = run_one(eng, make_request("a2", a, max_tokens=1, logprobs=0)).last[0]
    ref = run_one(LLMEngine(tiny_config(enable_prefix_caching=False)), make_request("a2", a, max_tokens=1, logprobs=0)).last[0]
    assert eng.store.host.stats.hit_blocks > 0
    assert again.logprobs[0].logprob != pytest.approx(ref.logprobs[0].logprob, abs=1e-6)
    assert first.finished


def test_no_host_tier_means_no_host_state():
    eng = LLMEngine(tiny_config())
    assert eng.cache_state().host is None and eng.storage.host_k is None
    with pytest.raises(ValueError, match="host_blocks"):
        tiny_config(host_blocks=-1)
