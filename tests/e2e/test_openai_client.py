"""The official ``openai`` client against an in-process router and a real replica.

Reference values come from a plain ``LLMEngine`` with the replica's config whose logits
are recorded (``RecordingEngine``): logprobs must equal their log-softmax, penalized
greedy tokens must equal the argmax of OpenAI's formula applied to them.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from unicache.contract.tokenizer import load_tokenizer
from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.engine import LLMEngine
from tests.support.load_stack import fast_engine_config

MODEL = "unicache-default"
TOKENIZER = load_tokenizer(fast_engine_config().tokenizer_path())


class RecordingEngine(LLMEngine):
    """An LLMEngine that keeps the raw logits row of every sampling step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[torch.Tensor] = []

    def _forward(self, chunks, tables):
        logits = super()._forward(chunks, tables)
        if logits is not None:
            self.rows.extend(logits.clone())
        return logits


def reference(prompt: str, max_tokens: int, **sampling) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw logits row before each, from a fresh engine."""
    engine = RecordingEngine(fast_engine_config())
    engine.add_request(EngineRequest("ref", list(prompt.encode()), SamplingParams(max_tokens=max_tokens, **sampling)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens, engine.rows[: len(tokens)]


@pytest.fixture
def stack(one_replica_stack):
    return one_replica_stack


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="key-acme", max_retries=0)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CHAT_PREFIX = "<|user|>\n{}\n<|assistant|>\n"


async def test_chat_logprobs_equal_the_engines_log_softmax(client):
    text = "logprobs, please"
    tokens, rows = reference(CHAT_PREFIX.format(text), 5)
    r = await client.chat.completions.create(model=MODEL, messages=chat(text), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens) == 5
    for entry, tok, row in zip(content, tokens, rows):
        logp = torch.log_softmax(row.float(), dim=-1)
        values, ids = torch.topk(logp, 3)
        assert entry.token == TOKENIZER.decode([tok])
        assert [t.token for t in entry.top_logprobs] == [TOKENIZER.decode([i]) for i in ids.tolist()]
        assert entry.logprob == pytest.approx(float(logp[tok]), abs=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-6)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top token
    # No logprobs asked: none returned.
    r = await client.chat.completions.create(model=MODEL, messages=chat(text), max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


async def test_completion_logprobs_is_the_legacy_object(client):
    prompt = "legacy logprobs"
    tokens, rows = reference(prompt, 4)
    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    want = [float(torch.log_softmax(row.float(), dim=-1)[t]) for t, row in zip(tokens, rows)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-6)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and all(len(d) <= 2 for d in lp.top_logprobs)
    # More alternatives than the engine allows: a 400 naming the limit.
    with pytest.raises(openai.BadRequestError, match="logprobs must be in"):
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=21)


async def test_penalties_follow_openais_formula_deterministically(client):
    prompt = "penalize repeats"
    plain, _ = reference(prompt, 16, temperature=0.0)
    assert len(set(plain)) < len(plain)  # the unpenalized greedy output repeats a token
    fp, pp = 1.5, 0.5
    tokens, rows = reference(prompt, 16, frequency_penalty=fp, presence_penalty=pp)
    counts: dict[int, int] = {}
    for tok, row in zip(tokens, rows):
        adjusted = row.clone()
        for t, c in counts.items():
            adjusted[t] -= c * fp + pp
        assert tok == int(torch.argmax(adjusted))
        counts[tok] = counts.get(tok, 0) + 1
    assert tokens != plain
    outs = []
    for _ in range(2):
        r = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, frequency_penalty=fp, presence_penalty=pp
        )
        outs.append(r.choices[0].text)
    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert outs[0] == outs[1] == TOKENIZER.decode(tokens)
    assert r.choices[0].text != outs[0]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, presence_penalty=2.5)
    assert exc.value.body["param"] == "presence_penalty"


async def test_stop_token_ids_end_the_choice_without_its_text(client):
    prompt = "stop on a token"
    tokens, _ = reference(prompt, 12)
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [tokens[k]]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == TOKENIZER.decode(tokens[:k])
    assert r.usage.completion_tokens == k + 1


async def test_unknown_model_is_404_and_models_are_listed(client):
    with pytest.raises(openai.NotFoundError) as exc:
        await client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        await client.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("chat", {"extra_body": {"guided_json": {}}}, "guided_json"),
        ("completions", {"suffix": "tail"}, "suffix"),
        ("completions", {"best_of": 3}, "best_of"),
    ],
)
async def test_unsupported_parameter_is_400_naming_it(client, stack, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            await client.chat.completions.create(model=MODEL, messages=chat("x"), max_tokens=1, **extra)
        else:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1, **extra)
    assert exc.value.body == {
        "message": f"unsupported parameter: {param!r} is not supported by this server",
        "type": "invalid_request_error",
        "param": param,
        "code": "unsupported_parameter",
    }
    assert stack.served_ids() == []


async def test_noop_values_of_unimplemented_parameters_are_accepted(client):
    r = await client.chat.completions.create(
        model=MODEL, messages=chat("x"), max_tokens=1, tools=[], response_format={"type": "text"}, logit_bias={}, user="u1"
    )
    assert len(r.choices) == 1
    r = await client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=1, suffix="")
    assert len(r.choices) == 1


async def test_unknown_paths_and_wrong_methods_are_openai_json(stack):
    async with httpx.AsyncClient(base_url=stack.http_url) as c:
        r = await c.get("/v1/nope")
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "Invalid URL (GET /v1/nope)", "type": "invalid_request_error", "param": None, "code": "unknown_url"}}
        r = await c.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = await c.delete("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


async def test_batch_prompts_and_n_order_choices_like_openai(client):
    prompts = ["first prompt", "second one"]
    refs = [reference(p, 3)[0] for p in prompts]
    tok = TOKENIZER
    r = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [tok.decode(refs[0])] * 2 + [tok.decode(refs[1])] * 2
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)
    assert r.usage.completion_tokens == 12
    # Token-id prompts, streamed: every choice ends once.
    stream = await client.completions.create(model=MODEL, prompt=[list(b"ab"), list(b"cd")], max_tokens=2, stream=True)
    finished = [c.index async for chunk in stream for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [0, 1]
    r = await client.chat.completions.create(model=MODEL, messages=chat("n"), max_tokens=2, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]


async def test_stream_include_usage(client):
    stream = await client.chat.completions.create(
        model=MODEL, messages=chat("usage"), max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == []
    prompt_tokens = len(CHAT_PREFIX.format("usage").encode())
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 3)
    assert chunks[0].choices[0].delta.role == "assistant"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=chat("x"), stream_options={"include_usage": True})
    assert exc.value.body["param"] == "stream_options"


async def test_echo_and_max_tokens_zero(client, stack):
    r = await client.completions.create(model=MODEL, prompt="echo me", max_tokens=0, echo=True)
    assert [(c.text, c.finish_reason) for c in r.choices] == [("echo me", "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 0)
    assert stack.served_ids() == []  # nothing to generate: no replica call
    tokens, _ = reference("echo me", 2)
    r = await client.completions.create(model=MODEL, prompt="echo me", max_tokens=2, echo=True, temperature=0)
    assert r.choices[0].text == "echo me" + TOKENIZER.decode(tokens)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert exc.value.body["param"] == "echo"


async def test_defaults_and_context_length(client, stack):
    # OpenAI's default temperature is 1: seeded requests repeat.
    seeded = [(await client.completions.create(model=MODEL, prompt="defaults", seed=3)).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    r = await client.completions.create(model=MODEL, prompt="defaults", seed=3)
    assert r.usage.completion_tokens <= 16  # completions default: 16 tokens
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt="w" * 600, max_tokens=2)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=chat("w" * 600))
    assert exc.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "bad \\ud800 text", "max_tokens": 1}',
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
        b'{"prompt": "x", "max_tokens": 1, "session_id": "s\\ud800"}',
        b'{"prompt": "x", "max_tokens": 1, "\\ud800": 1}',
    ],
)
async def test_lone_surrogates_are_400(stack, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    async with httpx.AsyncClient(base_url=stack.http_url) as c:
        r = await c.post(path, content=body, headers={"x-api-key": "key-acme", "content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_unicode"
    assert stack.served_ids() == []


async def test_deep_nesting_is_400(stack):
    async with httpx.AsyncClient(base_url=stack.http_url) as c:
        for depth in (65, 100_000):
            body = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
            r = await c.post("/v1/completions", content=body, headers={"x-api-key": "key-acme"})
            assert r.status_code == 400, depth
            assert r.json()["error"]["code"] == "invalid_json"
        # 64 levels is within the bound (then refused for what it is: user must be a string).
        body = json.dumps({"prompt": "x", "user": json.loads("[" * 63 + "]" * 63)}).encode()
        r = await c.post("/v1/completions", content=body, headers={"x-api-key": "key-acme"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
