"""Property-based fuzzing of the router's OpenAI-compatible HTTP API against real replicas.

Each generated request (raw bytes or a JSON object with right, wrong, missing and unknown
fields; good, bad and missing keys; bogus label headers) has one right status, computed by
an independent oracle from the documented rules (docs/openai.md): 401 bad key, 413 body
over the limit, 400 anything malformed, out of range (router or engine rule) or
unsupported (an unknown field), 400 prompt + max_tokens beyond the context, else 200 with
a well-formed body. Never 500. After the run no KV block
is referenced on any replica and both replicas still serve.

Example count: ``UNICACHE_FUZZ_EXAMPLES`` (default 150 per property).
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from unicache.router.frontends.http_api import DEFAULT_MAX_BODY_BYTES
from tests.support.fuzz_stack import serves_over_http, stack_fixture

EXAMPLES = int(os.environ.get("UNICACHE_FUZZ_EXAMPLES", "150"))
MAX_MODEL_LEN, MAX_N, DEFAULT_MAX_TOKENS, VOCAB, MAX_LOGPROBS = 512, 16, 16, 259, 20
MAX_SESSION_ID = 256  # RouterCore.max_session_id_chars
TASKS = ("chat", "agent", "code", "math", "qa", "tool", "other")
KEYS = {"key-acme", "key-beta"}
COUNTS: dict[int, int] = {}
MISSING = object()


def mostly(good, hostile, percent_hostile: int = 15):
    return st.integers(0, 999).map(lambda k: (k * 7919 + 37) % 100).flatmap(lambda k: hostile if k < percent_hostile else good)


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
wrong_type = st.one_of(json_scalar, st.lists(json_scalar, max_size=3), st.dictionaries(st.text(max_size=5), json_scalar, max_size=2))
huge = st.sampled_from([10**30, -(10**30), 1e300, -1e300, 2**64, 2**32])


def field(good, percent_hostile: int = 4):
    """A body field: usually ``good`` or absent, sometimes a hostile value."""
    return mostly(st.one_of(good, st.just(MISSING)), st.one_of(wrong_type, huge, st.just(MISSING)), percent_hostile)


short_text = st.text(max_size=40)
prompt = mostly(
    st.one_of(st.text(min_size=1, max_size=80), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)),
    st.one_of(
        st.just(""),
        st.just([]),
        st.lists(st.integers(-5, 400), min_size=1, max_size=5),
        st.integers(500, 3000).map(lambda n: "y" * n),
        st.text(max_size=5).map(lambda t: [t]),
        wrong_type,
        st.just(MISSING),
    ),
    30,
)
messages = mostly(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": short_text}), min_size=1, max_size=3
    ),
    st.one_of(st.just([]), st.just([{"role": "wizard", "content": "x"}]), st.just([{"role": "user", "content": 5}]), wrong_type),
    30,
)
body_fields = st.fixed_dictionaries(
    {
        "max_tokens": field(st.integers(0, 6)),
        "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0, 1)),
        "n": field(st.integers(1, 3)),
        "seed": field(st.integers(0, 2**64 - 1)),
        "stop": field(st.one_of(short_text, st.lists(short_text, max_size=2))),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "session_id": field(mostly(short_text, st.text(min_size=250, max_size=400), 10)),
        "task": field(st.sampled_from(TASKS)),
        "template": field(st.booleans()),
    }
)
headers = st.fixed_dictionaries(
    {
        "auth": mostly(
            st.sampled_from([("authorization", "Bearer key-acme"), ("x-api-key", "key-beta")]),
            st.sampled_from([None, ("authorization", "Bearer nope"), ("x-api-key", "key-acme2"), ("authorization", "key-acme")]),
            10,
        ),
        # (h11 refuses to send a header value with leading or trailing blanks)
        "x-session-id": st.one_of(st.none(), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300).map(str.strip)),
        "x-unicache-task": mostly(st.one_of(st.none(), st.sampled_from(TASKS)), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=10)),
        "x-unicache-template": mostly(st.one_of(st.none(), st.sampled_from(["true", "false", "1", "0"])), st.sampled_from(["yes", "", "2"])),
    }
)
raw_body = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"{", b"[1, 2]", b'"x"', b"null", b'{"prompt": "\xff\xfe"}', b"[" * 100_000, b'{"max_tokens": ' + b"9" * 5000 + b"}"]),
)
case = st.fixed_dictionaries(
    {
        "chat": st.booleans(),
        "headers": headers,
        "raw": mostly(st.none(), raw_body, 15),
        "prompt": prompt,
        "messages": messages,
        "fields": body_fields,
        "unknown": st.dictionaries(st.sampled_from(["foo", "logprobs", "user", "x"]), json_scalar, max_size=2),
    }
)


# --- oracle -------------------------------------------------------------------------
def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def num_ok(v, integer: bool, lo: float, hi: float) -> bool:
    if v is MISSING or v is None:
        return True
    if not is_num(v) or (integer and isinstance(v, float) and not v.is_integer()):
        return False
    return lo <= v <= hi


def json_body(c: dict) -> dict:
    body = dict(c["unknown"])
    if c["chat"]:
        if c["messages"] is not MISSING:
            body["messages"] = c["messages"]
    elif c["prompt"] is not MISSING:
        body["prompt"] = c["prompt"]
    body.update({k: v for k, v in c["fields"].items() if v is not MISSING})
    return body


def prompt_tokens(c: dict) -> int | None:
    """Prompt length in tokens, or None if the prompt/messages are malformed."""
    if c["chat"]:
        m = c["messages"]
        if not isinstance(m, list) or not m:
            return None
        if not all(isinstance(x, dict) and x.get("role") in ("system", "user", "assistant", "tool", "developer") for x in m):
            return None
        if not all(isinstance(x.get("content"), str) or x.get("content") is None for x in m):
            return None
        return len(("".join(f"<|{x['role']}|>\n{x.get('content') or ''}\n" for x in m) + "<|assistant|>\n").encode())
    p = c["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return len(p.encode())
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return len(p) if all(0 <= t < VOCAB for t in p) else None
    return None


def expected(c: dict) -> int:
    h = c["headers"]
    auth = h["auth"]
    if auth is None or (auth[0] == "authorization" and not auth[1].startswith("Bearer ")):
        return 401
    if (auth[1].removeprefix("Bearer ").strip() if auth[0] == "authorization" else auth[1]) not in KEYS:
        return 401
    if c["raw"] is not None:
        return 400  # none of the raw bodies is a JSON object with a prompt
    f = c["fields"]
    ntok = prompt_tokens(c)
    bad = ntok is None or ntok == 0
    bad |= not num_ok(f["max_tokens"], True, 1, 2**32 - 1)  # 0 only with echo
    bad |= not num_ok(f["temperature"], False, 0, 2)
    bad |= not num_ok(f["top_p"], False, 0, 1)
    bad |= not num_ok(f["n"], True, 1, 128)
    bad |= not num_ok(f["seed"], True, 0, 2**64 - 1)
    stop = f["stop"]
    bad |= not (stop in (MISSING, None) or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)))
    bad |= not any(f["stream"] is v for v in (MISSING, None, True, False))  # by identity: 0 == False is no boolean
    options = f["stream_options"]
    if options not in (MISSING, None):  # only with stream: true; only include_usage (a boolean)
        bad |= f["stream"] is not True or not isinstance(options, dict)
        bad |= isinstance(options, dict) and any(k != "include_usage" or v not in (None, True, False) for k, v in options.items())
    for name, value in c["unknown"].items():
        if name in ("foo", "x"):
            bad = True  # unsupported parameter, refused by name
        elif name == "user":
            bad |= value is not None and not isinstance(value, str)
        elif name == "logprobs" and c["chat"]:
            bad |= value not in (None, True, False)
        elif name == "logprobs":
            bad |= not num_ok(value, True, 0, MAX_LOGPROBS)  # beyond: the engine's 400
    template = f["template"] if f["template"] is not MISSING else h["x-unicache-template"]
    bad |= template is not None and not isinstance(template, bool) and not (isinstance(template, str) and template.lower() in ("true", "false", "1", "0"))
    session = f["session_id"] if f["session_id"] is not MISSING else h["x-session-id"]
    bad |= session is not None and not isinstance(session, str)
    bad |= isinstance(session, str) and len(session) > MAX_SESSION_ID
    task = f["task"] if f["task"] is not MISSING else h["x-unicache-task"]
    bad |= task is not None and not isinstance(task, str)
    bad |= isinstance(task, str) and task != "" and task not in TASKS
    if bad:
        return 400
    # Engine rules (all 400 before the context check).
    # Unset max_tokens: 16 for completions, the rest of the context (at least 1) for chat.
    mt = int(f["max_tokens"]) if is_num(f["max_tokens"]) else (1 if c["chat"] else DEFAULT_MAX_TOKENS)
    n = int(f["n"]) if is_num(f["n"]) else 1
    stops = [stop] if isinstance(stop, str) else (stop if isinstance(stop, list) else [])
    if mt > MAX_MODEL_LEN or n > MAX_N or "" in stops:
        return 400
    if ntok + mt > MAX_MODEL_LEN:
        return 400  # context_length_exceeded: can never fit (not a 429, which tells clients to retry)
    return 200


def request_parts(c: dict) -> tuple[bytes, dict]:
    h = c["headers"]
    hdrs = {"content-type": "application/json"}
    if h["auth"] is not None:
        hdrs[h["auth"][0]] = h["auth"][1]
    for name in ("x-session-id", "x-unicache-task", "x-unicache-template"):
        if h[name] is not None:
            hdrs[name] = h[name]
    content = c["raw"] if c["raw"] is not None else json.dumps(json_body(c)).encode()
    return content, hdrs


stack = stack_fixture(serves_over_http, lambda: f"\nHTTP fuzz cases by expected status: {dict(sorted(COUNTS.items()))}")


@given(c=case)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
async def test_every_request_gets_the_right_status(stack, c):
    want = expected(c)
    COUNTS[want] = COUNTS.get(want, 0) + 1
    content, hdrs = request_parts(c)
    path = "/v1/chat/completions" if c["chat"] else "/v1/completions"
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:
        r = await client.post(path, content=content, headers=hdrs)
    assert r.status_code == want, (r.status_code, r.text[:300])
    if want != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["code"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
    else:
        n = int(c["fields"]["n"]) if is_num(c["fields"]["n"]) else 1
        data = r.json()
        assert [ch["index"] for ch in data["choices"]] == list(range(n))
        assert data["usage"]["prompt_tokens"] == prompt_tokens(c)
    assert stack.app.cluster.total_in_flight() == 0


@pytest.mark.parametrize("declared", [True, False])
async def test_oversized_body_gets_413_without_being_read_whole(stack, declared):
    body = b'{"prompt": "' + b"z" * DEFAULT_MAX_BODY_BYTES + b'"}'
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:
        if declared:
            r = await client.post("/v1/completions", content=body, headers={"x-api-key": "key-acme"})
        else:  # chunked: no content-length, the limit trips while streaming

            async def chunks():
                for i in range(0, len(body), 1 << 16):
                    yield body[i : i + (1 << 16)]

            r = await client.post("/v1/completions", content=chunks(), headers={"x-api-key": "key-acme"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert stack.served_ids() == []
