"""One rule for how much of a repeated prompt a cache may serve: all but the last token.

The replica's scheduler, the simulator and the fake replica the router tests use all cap
hits with ``reusable_prompt_blocks``; for the same prompt sent twice they report the same
cached tokens.
"""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import reusable_prompt_blocks
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.trace import TraceRequest
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, replica_pb2
from tests.support.engine_factory import make_request, run_one, tiny_config

BS = 4  # tiny_config's block size
LENGTHS = [1, 3, 4, 5, 7, 8, 9, 12, 13]
# NOTE: a prompt of n tokens reuses (n - 1) // BS blocks, one less than its full blocks
# when n is a multiple of the block size.
EXPECTED_BLOCKS = {1: 0, 3: 0, 4: 0, 5: 1, 7: 1, 8: 1, 9: 2, 12: 2, 13: 3}


def test_reusable_prompt_blocks():
    assert {n: reusable_prompt_blocks(n, BS) for n in LENGTHS} == EXPECTED_BLOCKS
    assert reusable_prompt_blocks(0, BS) == 0
    assert reusable_prompt_blocks(32, 16) == 1 and reusable_prompt_blocks(33, 16) == 2
    with pytest.raises(ValueError):
        reusable_prompt_blocks(8, 0)


def replica_cached_tokens(n: int) -> int:
    eng = LLMEngine(tiny_config())
    prompt = list(range(10, 10 + n))
    run_one(eng, make_request("first", prompt, max_tokens=1))
    return run_one(eng, make_request("again", prompt, max_tokens=1)).last[0].usage.cached_tokens


def sim_cached_tokens(n: int) -> int:
    ids = list(range(1, -(-n // BS) + 1))  # one id per block, the last may be partial
    trace = [TraceRequest(index=i, timestamp_ms=1000.0 * i, input_length=n, output_length=1, hash_ids=ids)
             for i in range(2)]
    sim = Replay(prepare(trace, BS), ReplayConfig("lru", capacity_blocks=64))
    res = sim.run()
    return res["hit_blocks"] * BS  # the first request misses everything


async def fake_cached_tokens(n: int) -> int:
    fake = FakeReplica("r0", block_size=BS)
    req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=list(range(10, 10 + n))),
                                      sampling=common_pb2.SamplingParams(max_tokens=1))
    usage = None
    for _ in range(2):
        async for msg in fake.Generate(req, context=None):
            usage = msg.usage if msg.HasField("usage") else usage
    return usage.cached_tokens


@pytest.mark.parametrize("n", LENGTHS)
async def test_replica_simulator_and_fake_agree_on_a_repeated_prompt(n):
    expected = EXPECTED_BLOCKS[n] * BS
    assert replica_cached_tokens(n) == expected
    assert sim_cached_tokens(n) == expected
    assert await fake_cached_tokens(n) == expected
