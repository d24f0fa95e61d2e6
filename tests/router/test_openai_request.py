"""``unicache.router.frontends.openai_request``: defaults, refusals and the structure check, exactly."""

from __future__ import annotations

import pytest

from unicache.router.frontends.openai_errors import ApiError
from unicache.router.cluster.models import ModelCard, ServedModels
from unicache.router.frontends.openai_request import check_fields, check_model, check_unicode, parse_body, parse_request


def parse(body: dict, chat: bool = False):
    check_fields(body, chat)
    return parse_request(body, chat, lambda name: None, vocab=259)


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    return exc.value


def test_openai_defaults():
    s = parse({"prompt": "x"}).sampling
    assert (s.temperature, s.top_p, s.n, s.max_tokens, s.fill_context) == (1.0, 1.0, 1, 16, False)
    assert not s.HasField("seed") and not s.HasField("logprobs")
    s = parse({"messages": []}, chat=True).sampling
    assert (s.temperature, s.max_tokens, s.fill_context) == (1.0, 0, True)  # chat: up to the context
    s = parse({"messages": [], "max_completion_tokens": 7, "max_tokens": 3}, chat=True).sampling
    assert (s.max_tokens, s.fill_context) == (7, False)


def test_sampling_fields_reach_the_proto():
    body = {
        "prompt": [[1, 2], [3]], "temperature": 0, "top_p": 0, "n": 2, "seed": 9, "stop": "END",
        "stop_token_ids": [5, 6], "presence_penalty": -1.5, "frequency_penalty": 0.25, "logprobs": 3,
    }  # fmt: skip
    req = parse(body)
    s = req.sampling
    assert req.prompts == [[1, 2], [3]] and req.batched
    assert (s.temperature, s.n, s.seed, list(s.stop), list(s.stop_token_ids)) == (0.0, 2, 9, ["END"], [5, 6])
    assert s.top_p == pytest.approx(1e-6)  # OpenAI's top_p 0 keeps the top token only
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, req.logprobs) == (-1.5, 0.25, 3, 3)
    chat = parse({"messages": [], "logprobs": True, "top_logprobs": 4}, chat=True)
    assert (chat.sampling.logprobs, chat.logprobs) == (4, 4)
    assert parse({"messages": [], "logprobs": True}, chat=True).sampling.logprobs == 0
    assert parse({"messages": [], "logprobs": False}, chat=True).logprobs is None


@pytest.mark.parametrize(
    ("body", "chat", "param", "code"),
    [
        ({"prompt": "x", "tools": [{}]}, False, "tools", "unsupported_parameter"),
        ({"messages": [], "tools": [{"type": "function"}]}, True, "tools", "unsupported_parameter"),
        ({"messages": [], "response_format": {"type": "json_schema"}}, True, "response_format", "unsupported_parameter"),
        ({"messages": [], "echo": True}, True, "echo", "unsupported_parameter"),
        ({"prompt": "x", "top_logprobs": 2}, False, "top_logprobs", "unsupported_parameter"),
        ({"prompt": "x", "best_of": 2}, False, "best_of", "unsupported_parameter"),
        ({"prompt": "x", "mystery": None}, False, "mystery", "unsupported_parameter"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens", "invalid_value"),
        ({"messages": [], "max_completion_tokens": 0}, True, "max_completion_tokens", "invalid_value"),
        ({"messages": [], "top_logprobs": 2}, True, "top_logprobs", "invalid_value"),
        ({"messages": [], "logprobs": 2}, True, "logprobs", "invalid_value"),
        ({"prompt": "x", "logprobs": True}, False, "logprobs", "invalid_value"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options", "invalid_value"),
        ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, False, "stream_options.continuous_usage_stats", "unsupported_parameter"),
        ({"prompt": "x", "frequency_penalty": -2.01}, False, "frequency_penalty", "invalid_value"),
        ({"prompt": "x", "stop_token_ids": [-1]}, False, "stop_token_ids", "invalid_value"),
        ({"prompt": [], "max_tokens": 1}, False, "prompt", "invalid_value"),
        ({"prompt": [[1], "a", [True]]}, False, "prompt", "invalid_value"),
        ({"prompt": [[1, 300]]}, False, "prompt", "invalid_value"),
        ({"prompt": ["a"] * 65}, False, "prompt", "invalid_value"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, False, "echo", "unsupported_parameter"),
    ],
)
def test_refusals_name_the_parameter(body, chat, param, code):
    err = refused(parse, body, chat)
    assert (err.status, err.param, err.code) == (400, param, code)


def test_echo_with_zero_tokens_generates_nothing():
    req = parse({"prompt": ["a", "b"], "echo": True, "max_tokens": 0})
    assert (req.echo, req.generate, req.prompts) == (True, False, ["a", "b"])


def test_model_check():
    served = ServedModels("m")
    assert (check_model({"model": "m"}, served), check_model({}, served)) == ("m", "")
    err = refused(check_model, {"model": "other"}, served)
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert err.message == "The model 'other' does not exist; this server serves 'm'"
    served.set_backend("b", [ModelCard("other")])
    assert check_model({"model": "other"}, served) == "other"
    assert refused(check_model, {"model": 3}, served).status == 400


def test_body_check_bounds_depth_and_unicode():
    assert parse_body(b'{"a": [[["x"]]]}', max_depth=4) == {"a": [[["x"]]]}
    assert refused(parse_body, b'{"a": [[["x"]]]}', 3).code == "invalid_json"
    check_unicode({"a": ["ok", {"b": "\u00e9"}]})
    assert refused(check_unicode, {"a": ["ok", {"b": "\ud800"}]}).code == "invalid_unicode"
    assert refused(check_unicode, {"\udc00": 1}).code == "invalid_unicode"
    assert refused(parse_body, b"[1]").code == "invalid_json"  # not an object
    assert refused(parse_body, b'{"a": "\xff"}').code == "invalid_json"  # not UTF-8
    assert parse_body('{"a": "\\u00e9\\ud83d\\ude00"}'.encode()) == {"a": "\u00e9\U0001f600"}  # a valid pair
