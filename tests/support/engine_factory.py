"""Factories for engine tests: a tiny seeded model and a synchronous driver."""

from __future__ import annotations

from dataclasses import dataclass, field

from unicache.replica.engines.api import EngineOutput, EngineRequest, SamplingParams
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.model import ModelConfig

TINY_MODEL = dict(
    vocab_size=259, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=512
)


def tiny_config(**overrides) -> EngineConfig:
    """Tiny model, block size 4, CPU, plain LRU (tests must not depend on other policies)."""
    kw = dict(
        model=ModelConfig(**TINY_MODEL),
        num_blocks=128,
        block_size=4,
        eviction_policy="lru",
        device="cpu",
        max_num_batched_tokens=256,
        seed=7,
    )
    kw.update(overrides)
    return EngineConfig(**kw)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **sampling) -> EngineRequest:
    sampling.setdefault("ignore_eos", True)
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


@dataclass
class Result:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    last: dict[int, EngineOutput] = field(default_factory=dict)


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, Result]:
    """Step until every request finished; collect tokens, streamed text and last outputs."""
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            r = results.setdefault(out.request_id, Result())
            r.tokens.setdefault(out.index, []).extend(out.new_token_ids)
            r.text[out.index] = r.text.get(out.index, "") + out.text_delta
            if out.finished:
                r.last[out.index] = out
    raise AssertionError("engine did not finish")


def run_one(engine: LLMEngine, req: EngineRequest) -> Result:
    engine.add_request(req)
    return drain(engine)[req.request_id]
