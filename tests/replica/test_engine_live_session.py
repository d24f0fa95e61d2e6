"""A live chat session survives one-off traffic on the built-in engine (issue 11).

One replica, 64 KV blocks of 32 tokens. A chat session with an explicit session id sends
its first turn (500 prompt tokens + 16 generated: 16 full blocks), six unique single-turn
prompts follow (300 tokens + 16 generated: 10 blocks each), then the session's second
turn (536 prompt tokens: the first turn, its answer and 20 new tokens). The classes come
from the router's classifier, as on the live path; a fake clock puts 10 s between
requests. From a cold start, lru keeps the session's first 9 blocks (the oldest blocks
go first, tail first) and unicache all 16: the one-off requests leave first.
"""

from __future__ import annotations

import random

import pytest

from unicache.contract.block_hash import hash_token_blocks
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.router.request_path.classifier import Labels, RequestClassifier
from tests.support.engine_factory import TINY_MODEL, drain, make_request, tiny_config

BS = 32


def second_turn_cached_tokens(policy: str, gap_s: float = 10.0) -> tuple[int, int]:
    now = [0.0]
    engine = LLMEngine(
        tiny_config(
            model=ModelConfig(**{**TINY_MODEL, "max_position": 1024}),
            num_blocks=64,
            block_size=BS,
            eviction_policy=policy,
            max_num_batched_tokens=1024,
        ),
        clock=lambda: now[0],
    )
    classifier = RequestClassifier()
    rng = random.Random(1)

    def run(rid: str, prompt: list[int], labels: Labels | None, max_tokens: int = 16):
        req = make_request(rid, prompt, max_tokens=max_tokens)
        req.cls = classifier.classify(hash_token_blocks(prompt, BS), labels, now[0])
        engine.add_request(req)
        out = drain(engine)[rid]
        now[0] += gap_s
        return req.cls, out

    turn1 = [rng.randrange(1, 256) for _ in range(500)]
    cls1, out1 = run("turn1", turn1, Labels(session_id="chat-1"))
    for i in range(6):
        cls, _ = run(f"one-off-{i}", [rng.randrange(1, 256) for _ in range(300)], None)
        assert cls.session_id is None and not cls.template
    turn2 = turn1 + out1.tokens[0] + [rng.randrange(1, 256) for _ in range(20)]
    cls2, out2 = run("turn2", turn2, Labels(session_id="chat-1"), max_tokens=4)
    assert (cls1.session_id, cls1.turn, cls2.session_id, cls2.turn) == ("chat-1", 0, "chat-1", 1)
    return out2.last[0].usage.prompt_tokens, out2.last[0].usage.cached_tokens


@pytest.mark.parametrize("policy, cached", [("lru", 9 * BS), ("unicache", 16 * BS)])
def test_live_session_prefix_survives_one_off_prompts(policy, cached):
    assert second_turn_cached_tokens(policy) == (536, cached)
