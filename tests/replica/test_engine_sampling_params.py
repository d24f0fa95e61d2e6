"""Engine-level OpenAI sampling features: logprobs, penalties, stop_token_ids, max_tokens None."""

from __future__ import annotations

import pytest
import torch

from unicache.replica.engines.api import EngineInputError, SamplingParams
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.sampling import apply_penalties, token_logprob
from tests.support.engine_factory import drain, make_request, run_one, tiny_config

PROMPT = [10, 20, 30, 40, 50, 60]


def test_apply_penalties_is_openais_formula_and_leaves_the_input_alone():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, {1: 2, 3: 1}, params)
    assert out.tolist() == [1.0, 2.0 - 2 * 0.25 - 0.5, 3.0, 4.0 - 0.25 - 0.5]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert apply_penalties(logits, {}, params) is logits


def test_token_logprob_is_log_softmax_with_top_k():
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0])
    lp = token_logprob(logits, 2, 2)
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in lp.top] == [1, 3] and [v for _, v in lp.top] == pytest.approx([float(ref[1])] * 2)
    assert token_logprob(logits, 0, 0).top == []


def test_logprobs_come_with_every_token_of_every_sample():
    engine = LLMEngine(tiny_config())
    res = run_one(engine, make_request("a", PROMPT, max_tokens=5, n=2, temperature=1.0, seed=4, logprobs=3))
    outs = []
    engine.add_request(make_request("b", PROMPT, max_tokens=5, n=2, temperature=1.0, seed=4, logprobs=3))
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert sorted({o.index for o in outs}) == [0, 1]
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids) == 1 for o in outs)
    assert all(len(o.logprobs[0].top) == 3 for o in outs)
    assert all(o.logprobs[0].logprob <= o.logprobs[0].top[0][1] + 1e-6 for o in outs)
    assert [t for o in outs if o.index == 0 for t in o.new_token_ids] == res.tokens[0]  # same seed, same draw
    res = run_one(engine, make_request("c", PROMPT, max_tokens=2))
    assert res.last[0].logprobs is None


def test_stop_token_id_finishes_with_its_id_but_not_its_text():
    engine = LLMEngine(tiny_config())
    free = run_one(engine, make_request("free", PROMPT, max_tokens=10)).tokens[0]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    res = run_one(engine, make_request("stop", PROMPT, max_tokens=10, stop_token_ids=[free[k]]))
    assert res.tokens[0] == free[: k + 1]
    assert res.last[0].finish_reason == "stop"
    assert res.text[0] == engine.tokenizer.decode(free[:k])
    assert res.last[0].usage.completion_tokens == k + 1


def test_max_tokens_none_generates_to_the_context():
    engine = LLMEngine(tiny_config(max_model_len=20))
    res = run_one(engine, make_request("fill", PROMPT, max_tokens=None))
    assert len(res.tokens[0]) == 20 - len(PROMPT) and res.last[0].finish_reason == "length"
    with pytest.raises(EngineInputError) as exc:
        engine.validate(make_request("full", list(range(1, 21)), max_tokens=None))
    assert exc.value.kind == "exhausted"


def test_penalties_count_each_samples_own_tokens():
    """Greedy n=2 with a penalty: each sample equals the single-sample output (shared
    counts would make the second sample see the first one's tokens and diverge)."""
    engine = LLMEngine(tiny_config())
    single = run_one(engine, make_request("one", PROMPT, max_tokens=12, frequency_penalty=2.0)).tokens[0]
    plain = run_one(engine, make_request("plain", PROMPT, max_tokens=12)).tokens[0]
    assert single != plain
    engine.add_request(make_request("two", PROMPT, max_tokens=12, n=2, frequency_penalty=2.0))
    res = drain(engine)["two"]
    assert res.tokens == {0: single, 1: single}
    assert engine.num_referenced_blocks() == 0


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2]"),
        ({"stop_token_ids": [259]}, "stop token id 259 outside the vocabulary"),
    ],
)
def test_out_of_range_sampling_is_invalid(sampling, message):
    engine = LLMEngine(tiny_config())
    with pytest.raises(EngineInputError) as exc:
        engine.validate(make_request("x", PROMPT, **sampling))
    assert exc.value.kind == "invalid" and message in str(exc.value)
