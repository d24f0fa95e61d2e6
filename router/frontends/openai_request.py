"""Parsing and validating an OpenAI request body (pure functions, no I/O).

``parse_body`` turns the raw bytes into a JSON object whose nesting is at most
``max_depth`` (checked before parsing, ``json_input``) and whose strings (keys too) are
valid Unicode (a JSON ``"\\ud800"`` is a
lone surrogate, which UTF-8 cannot encode: 400, not a 500 later). ``parse_request`` then
reads the fields of ``/v1/completions`` or ``/v1/chat/completions`` into an
``OpenAIRequest`` with the proto ``SamplingParams`` the replicas get.

Every field is either implemented, accepted because it changes nothing (``user``, a
null, or a value equal to the default such as ``best_of == n``), or refused with a 400
naming it (``code: unsupported_parameter``): nothing is silently ignored. The table is
in docs/openai.md.

Defaults (OpenAI's): temperature 1, top_p 1, n 1; ``max_tokens`` 16 for completions
(OpenAI's legacy default), up to the remaining context for chat (OpenAI's and vLLM's).
``max_tokens: 0`` is refused unless ``echo`` (which then returns the prompt only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from unicache.router.cluster.models import ServedModels
from unicache.router.frontends.json_input import MAX_JSON_DEPTH as DEFAULT_MAX_JSON_DEPTH, JsonInputError, loads_bounded
from unicache.router.frontends.openai_errors import ApiError, bad_request, unsupported
from unicache.router.request_path.core import Labelled
from unicache.v1 import common_pb2

DEFAULT_MAX_BATCH_PROMPTS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_N = 128
_MAX_U32 = 2**32 - 1

# Implemented fields of each endpoint (our extensions: session_id, task, template;
# vLLM's: stop_token_ids).
_COMMON = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
        "presence_penalty", "frequency_penalty", "seed", "user", "stop_token_ids", "logprobs",
        "session_id", "task", "template",
    }
)  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}

# Fields we do not implement but accept with a value that asks for nothing.
_NOOP: dict[str, Callable[[Any, dict], bool]] = {
    "logit_bias": lambda v, b: v == {},
    "suffix": lambda v, b: v == "",
    "best_of": lambda v, b: v == b.get("n", 1) or (v == 1 and b.get("n") is None),
    "tools": lambda v, b: v == [],
    "functions": lambda v, b: v == [],
    "tool_choice": lambda v, b: v == "none",
    "response_format": lambda v, b: v == {"type": "text"},
    "modalities": lambda v, b: v == ["text"],
    "store": lambda v, b: v is False,
    "parallel_tool_calls": lambda v, b: False,
    "service_tier": lambda v, b: v in ("auto", "default"),
}


@dataclass(slots=True)
class OpenAIRequest:
    """One parsed request. ``prompts`` holds one entry per batch prompt: token ids, or a
    string still to encode (``prompt_texts`` keeps what ``echo`` returns)."""

    chat: bool
    prompts: list[str | list[int]]
    sampling: common_pb2.SamplingParams
    labels: Labelled
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    generate: bool = True  # False: echo with max_tokens 0 (no replica call)
    batched: bool = False  # the prompt was a list of prompts
    model: str = ""  # the model it names ("": none, the router's own)
    extra: dict = field(default_factory=dict)


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict:
    """The JSON object in ``raw``; ApiError 400 for bad JSON or UTF-8, nesting deeper
    than ``max_depth`` (``json_input.loads_bounded``), invalid Unicode, or a body that is
    not an object."""
    try:
        body = loads_bounded(raw, "request body", max_depth)
    except JsonInputError as exc:
        raise bad_request(str(exc), code="invalid_json") from None
    check_unicode(body)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def _valid_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_BAD_UNICODE = "request contains invalid Unicode (a lone surrogate such as \\ud800)"


def check_unicode(obj: Any) -> None:
    """Every string and key of a parsed document is valid Unicode (iterative walk)."""
    stack: list[Any] = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not _valid_text(value):
                raise bad_request(_BAD_UNICODE, code="invalid_unicode")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not _valid_text(k):
                    raise bad_request(_BAD_UNICODE, code="invalid_unicode")
                if isinstance(v, (str, dict, list)):
                    stack.append(v)
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (str, dict, list)))


def number(body: dict, name: str, kind: type, lo: float, hi: float, default):
    """``body[name]`` as ``kind`` within [lo, hi]; missing or null: ``default``."""
    value = body.get(name)
    if value is None:
        return default
    # NOTE: no float(value) on ints: a huge JSON integer would overflow it (OverflowError).
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and (math.isnan(value) or (kind is int and not value.is_integer())))
    ):
        raise bad_request(f"{name} must be a{'n integer' if kind is int else ' number'}", name)
    if value < lo or value > hi:
        raise bad_request(f"{name} must be between {lo} and {hi}", name)
    return kind(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def unimplemented_fields(body: dict, chat: bool) -> list[str]:
    """The fields this endpoint does not implement (see ``_NOOP``), in the body's order."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    out = []
    for name, value in body.items():
        if name in allowed and name not in _NOOP:
            continue
        if name in _NOOP and (value is None or _NOOP[name](value, body)):
            continue
        out.append(name)
    return out


def check_fields(body: dict, chat: bool) -> None:
    """Refuse (by name) every field this endpoint does not implement (see ``_NOOP``)."""
    names = unimplemented_fields(body, chat)
    if names:
        raise unsupported(names[0])


def check_model(body: dict, served: ServedModels) -> str:
    """The model ``body`` names ("" when it names none: the router's own); a model no
    backend serves is 404 ``model_not_found`` (router/cluster/models.py)."""
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if not served.knows(model):
        names = ", ".join(repr(card.name) for card in served.cards())
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {names}", "model_not_found", "model")
    return model


MAX_LABEL_CHARS = 256  # as RouterCore's max_session_id_chars


def routing_header(header: Callable[[str], str | None], name: str, param: str) -> str | None:
    """A routing header's value as UTF-8 text: 400 (naming ``param``) for bytes that are
    not UTF-8, control characters, or more than ``MAX_LABEL_CHARS`` characters.

    NOTE: ASGI servers hand header bytes over as latin-1 text; re-encoding recovers them.
    """
    raw = header(name)
    if raw is None:
        return None
    try:
        value = raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise bad_request(f"{name} header is not valid UTF-8", param) from None
    check_label(value, f"{name} header", param)
    return value


CLIENT_TIMEOUT_HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")


def client_wait_budget_s(header: Callable[[str], str | None]) -> float | None:
    """The seconds an HTTP client says it waits for an answer to start: the smaller of the
    timeouts OpenAI's and other Stainless-generated SDKs send (``CLIENT_TIMEOUT_HEADERS``,
    seconds), None when it sends none. A value that is not a positive finite number is
    ignored: the SDKs send these on their own (one has sent the string ``NOT_GIVEN``), so
    a malformed one must not fail a request the client never shaped."""
    budget = None
    for name in CLIENT_TIMEOUT_HEADERS:
        raw = header(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            budget = value if budget is None else min(budget, value)
    return budget


def check_label(value: str, what: str, param: str) -> None:
    """400 for a label with control characters or longer than ``MAX_LABEL_CHARS``."""
    if len(value) > MAX_LABEL_CHARS:
        raise bad_request(f"{what} is longer than {MAX_LABEL_CHARS} characters", param)
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value):
        raise bad_request(f"{what} contains control characters", param)


def labels_from(body: dict, header: Callable[[str], str | None]) -> Labelled:
    """Explicit routing labels: body fields, else ``x-session-id``, ``x-unicache-task``,
    ``x-unicache-template`` headers (each checked by ``routing_header``)."""
    session = body["session_id"] if "session_id" in body else routing_header(header, "x-session-id", "session_id")
    task = body["task"] if "task" in body else routing_header(header, "x-unicache-task", "task")
    template = body["template"] if "template" in body else routing_header(header, "x-unicache-template", "template")
    if isinstance(template, str):
        if template.lower() not in ("true", "false", "1", "0"):
            raise bad_request("template must be a boolean", "template")
        template = template.lower() in ("true", "1")
    if template is not None and not isinstance(template, bool):
        raise bad_request("template must be a boolean", "template")
    if session is not None and not isinstance(session, str):
        raise bad_request("session_id must be a string", "session_id")
    if task is not None and not isinstance(task, str):
        raise bad_request("task must be a string", "task")
    return Labelled(session_id=session or None, task=task or None, template=template)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_prompts(prompt: Any, vocab: int | None, max_prompts: int) -> tuple[list[str | list[int]], bool]:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either (a batch).
    Returns (prompts, batched)."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        items, batched = [prompt], False
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        items, batched = list(prompt), len(prompt) > 1
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    if len(items) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(items)}", "prompt")
    for p in items:
        if isinstance(p, list) and any(t < 0 or (vocab is not None and t >= vocab) for t in p):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return items, batched


def _stop(body: dict, sampling: common_pb2.SamplingParams) -> None:
    stop = body.get("stop")
    if isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sampling.stop.extend(stop)
    elif stop is not None:
        raise bad_request("stop must be a string or a list of strings", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_U32 for t in ids):
        raise bad_request("stop_token_ids must be a list of non-negative token ids", "stop_token_ids")
    sampling.stop_token_ids.extend(ids)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top alternatives per token, or None. Completions: ``logprobs`` is that integer;
    chat: ``logprobs`` is a boolean and ``top_logprobs`` the integer."""
    if not chat:
        return number(body, "logprobs", int, 0, _MAX_U32, None)
    if not boolean(body, "logprobs"):
        if body.get("top_logprobs") is not None:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        return None
    return number(body, "top_logprobs", int, 0, _MAX_U32, 0)


def parse_request(
    body: dict,
    chat: bool,
    header: Callable[[str], str | None],
    vocab: int | None,
    max_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
) -> OpenAIRequest:
    """Validate ``body`` (already through ``check_fields`` and ``check_model``)."""
    if chat:
        prompts: list[str | list[int]] = []  # the front door renders the messages
        batched = False
        echo = False
    else:
        if "prompt" not in body:
            raise bad_request("prompt is required", "prompt")
        prompts, batched = parse_prompts(body.get("prompt"), vocab, max_prompts)
        echo = boolean(body, "echo")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, name, int, 0, _MAX_U32, None)
    if max_tokens == 0 and not echo:
        raise bad_request(f"{name} must be at least 1", name)
    top_p = number(body, "top_p", float, 0.0, 1.0, 1.0)
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens or 0,
        fill_context=chat and max_tokens is None,
        temperature=number(body, "temperature", float, 0.0, 2.0, 1.0),
        # NOTE: proto top_p 0 means "no truncation"; OpenAI's top_p 0 keeps only the top token.
        top_p=max(top_p, 1e-6),
        n=number(body, "n", int, 1, MAX_N, 1),
        presence_penalty=number(body, "presence_penalty", float, -2.0, 2.0, 0.0),
        frequency_penalty=number(body, "frequency_penalty", float, -2.0, 2.0, 0.0),
    )
    if not chat and max_tokens is None:
        sampling.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    seed = number(body, "seed", int, 0, 2**64 - 1, None)
    if seed is not None:
        sampling.seed = seed
    _stop(body, sampling)
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        if echo:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "unsupported_parameter", "echo")
        sampling.logprobs = logprobs
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        for key in options:
            if key != "include_usage":
                raise unsupported(f"stream_options.{key}")
        include_usage = boolean(options, "include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("user must be a string", "user")
    return OpenAIRequest(
        chat=chat,
        prompts=prompts,
        sampling=sampling,
        labels=labels_from(body, header),
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        logprobs=logprobs,
        generate=max_tokens != 0,
        batched=batched,
    )
