"""Property-based fuzzing of the router's gRPC ``Generate`` against real replicas.

Every generated request has one right answer, computed by an independent oracle from the
documented rules (auth, then model, then prompt, then labels, then the engine's limits in
its order): OK, INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND (a model not served, as
HTTP's 404) or RESOURCE_EXHAUSTED; never INTERNAL/UNKNOWN. After
each example no request is in flight, and after the run no KV block is referenced on any
replica and every process piece still serves. Raw-bytes cases (corrupt protobuf, invalid
UTF-8 in ``chat_json``/``text``) go through a bytes-level stub.

Example count: ``UNICACHE_FUZZ_EXAMPLES`` (default 150 per property).
"""

from __future__ import annotations

import json
import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from unicache.v1 import common_pb2, router_pb2
from tests.support.fuzz_stack import serves_over_grpc, stack_fixture

EXAMPLES = int(os.environ.get("UNICACHE_FUZZ_EXAMPLES", "150"))
MAX_MODEL_LEN = 512  # FAST_MODEL.max_position
MAX_N = 16  # EngineConfig.max_n
MAX_SESSION_ID = 256  # RouterCore.max_session_id_chars
DEFAULT_MAX_TOKENS = 16
TASKS = ("chat", "agent", "code", "math", "qa", "tool", "other")
KEYS = {"key-acme", "key-beta"}
SERVED_MODEL = "unicache-default"  # RouterConfig.served_model_name
OK, INVALID, UNAUTH, EXHAUSTED = (
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
COUNTS: dict[str, int] = {}

# --- strategies ---------------------------------------------------------------------
short_text = st.text(max_size=40)
prompt_text = st.one_of(
    st.just(""),
    short_text,
    st.text(min_size=1, max_size=600),
    st.integers(500, 5000).map(lambda n: "x" * n),  # longer than the context
)
messages_ok = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]), "content": short_text}),
    min_size=1,
    max_size=4,
)
messages_bad = st.one_of(
    st.just("not json {"),
    st.just("[]"),
    st.just("{}"),
    st.just('[{"role": "wizard", "content": "x"}]'),
    st.just('[{"role": "user", "content": 5}]'),
    st.just('["user"]'),
    st.just("null"),
)
def mostly(good, hostile, percent_hostile: int = 20):
    """``good`` most of the time, ``hostile`` in about ``percent_hostile``% of cases
    (``st.one_of`` weighs branches by its own rules)."""
    return st.integers(0, 999).map(lambda k: (k * 7919 + 37) % 100).flatmap(lambda k: hostile if k < percent_hostile else good)


good_auth = st.sampled_from([("authorization", "Bearer key-acme"), ("x-api-key", "key-beta")])
bad_auth = st.one_of(
    st.sampled_from([None, ("authorization", "Bearer nope"), ("authorization", "Basic key-acme"), ("x-api-key", "")]),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30).map(lambda k: ("x-api-key", k)),
)
# Mostly plausible values (so most cases reach the replicas), plus hostile ones.
f32 = st.floats(width=32)
sampling = st.fixed_dictionaries(
    {
        "max_tokens": mostly(st.integers(0, 6), st.one_of(st.sampled_from([512, 513, 2**32 - 1]), st.integers(0, 600))),
        "temperature": mostly(st.one_of(st.just(0.0), st.floats(0, 2, width=32)), st.one_of(st.sampled_from([-1.0, math.nan, math.inf]), f32)),
        "top_p": mostly(st.one_of(st.just(0.0), st.floats(0.0625, 1, width=32)), st.one_of(st.sampled_from([-0.5, 1.5, math.nan]), f32)),
        "n": mostly(st.integers(0, 3), st.one_of(st.sampled_from([17, 2**32 - 1]), st.integers(0, 20))),
        "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        "stop": mostly(st.just([]), st.lists(st.one_of(st.just(""), short_text), max_size=3)),
    }
)
request_case = st.fixed_dictionaries(
    {
        "auth": mostly(good_auth, bad_auth, 10),
        "prompt": mostly(
            st.one_of(
                st.text(min_size=1, max_size=80).map(lambda t: ("text", t, t)),
                messages_ok.map(lambda m: ("chat", json.dumps(m), m)),
            ),
            st.one_of(st.none(), prompt_text.map(lambda t: ("text", t, t)), messages_bad.map(lambda m: ("chat", m, None))),
            30,
        ),
        "sampling": sampling,
        "session_id": st.one_of(st.just(""), short_text, st.text(min_size=250, max_size=260), st.text(min_size=500, max_size=2000)),
        "task": mostly(st.one_of(st.just(""), st.sampled_from(TASKS)), st.one_of(st.sampled_from(["CHAT", "chat ", "bogus"]), short_text)),
        "template": st.one_of(st.none(), st.booleans()),
        "model": mostly(st.sampled_from(["", SERVED_MODEL]), short_text),
    }
)


# --- oracle -------------------------------------------------------------------------
def render(messages: list[dict]) -> str:
    """The documented chat template (docs/router.md), written out independently."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def f32round(x: float) -> float:
    return float(common_pb2.SamplingParams(temperature=x).temperature)


def expected(case: dict) -> tuple[grpc.StatusCode, int]:
    """(status, prompt tokens) the router must answer."""
    a = case["auth"]
    if a is None or a[1].strip() == "" or (a[0] == "authorization" and not a[1].startswith("Bearer ")):
        return UNAUTH, 0
    key = a[1].removeprefix("Bearer ").strip() if a[0] == "authorization" else a[1].strip()
    if key not in KEYS:
        return UNAUTH, 0
    if case["model"] not in ("", SERVED_MODEL):
        return grpc.StatusCode.NOT_FOUND, 0
    if case["prompt"] is None:
        return INVALID, 0
    kind, _, parsed = case["prompt"]
    if kind == "chat" and parsed is None:
        return INVALID, 0
    text = parsed if kind == "text" else render(parsed)
    ntok = len(text.encode())
    if ntok == 0 or len(case["session_id"]) > MAX_SESSION_ID:
        return INVALID, 0
    if case["task"] and case["task"] not in TASKS:
        return INVALID, 0
    s = case["sampling"]
    max_tokens = s["max_tokens"] or DEFAULT_MAX_TOKENS
    temperature, top_p = f32round(s["temperature"]), f32round(s["top_p"])
    top_p = 1.0 if top_p == 0 else top_p
    n = s["n"] or 1
    if not 1 <= max_tokens <= MAX_MODEL_LEN or not temperature >= 0 or not 0 < top_p <= 1 or n > MAX_N or "" in s["stop"]:
        return INVALID, ntok
    if ntok + max_tokens > MAX_MODEL_LEN:
        return EXHAUSTED, ntok
    return OK, ntok


def build(case: dict) -> router_pb2.RouterGenerateRequest:
    req = router_pb2.RouterGenerateRequest(session_id=case["session_id"], task=case["task"], model=case["model"])
    if case["prompt"] is not None:
        kind, raw, _ = case["prompt"]
        setattr(req, "text" if kind == "text" else "chat_json", raw)
    s = case["sampling"]
    req.sampling.max_tokens, req.sampling.temperature, req.sampling.top_p, req.sampling.n = (
        s["max_tokens"], s["temperature"], s["top_p"], s["n"]
    )
    if s["seed"] is not None:
        req.sampling.seed = s["seed"]
    req.sampling.stop.extend(s["stop"])
    if case["template"] is not None:
        req.template = case["template"]
    return req


stack = stack_fixture(serves_over_grpc, lambda: f"\ngRPC fuzz cases by expected outcome: {COUNTS}")


@given(case=request_case)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
async def test_generate_answers_every_request_with_the_right_status(stack, case):
    want, ntok = expected(case)
    md = [case["auth"]] if case["auth"] is not None else []
    got = OK
    finishes: dict[int, int] = {}
    tokens: dict[int, int] = {}
    usage_prompt = None
    try:
        async for m in stack.stub.Generate(build(case), metadata=md, timeout=60):
            tokens[m.index] = tokens.get(m.index, 0) + len(m.token_ids)
            if m.finish_reason:
                finishes[m.index] = finishes.get(m.index, 0) + 1
            if m.HasField("usage"):
                usage_prompt = m.usage.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        got = exc.code()
        assert exc.details(), "every error carries a message"
    COUNTS[want.name] = COUNTS.get(want.name, 0) + 1
    assert got == want, (case, got)
    if want == OK:
        n = case["sampling"]["n"] or 1
        max_tokens = case["sampling"]["max_tokens"] or DEFAULT_MAX_TOKENS
        assert finishes == {i: 1 for i in range(n)}  # each sample finished exactly once
        assert all(1 <= tokens.get(i, 0) <= max_tokens for i in range(n)), tokens
        assert usage_prompt == ntok
    assert stack.app.cluster.total_in_flight() == 0


RAW_CASES = [
    b"\x12\x03\xff\xfe\xfd",  # chat_json with invalid UTF-8
    b"\x0a\x02\xc3\x28",  # text with invalid UTF-8
    b"\x0a\x05hello\x1a\x03\x08",  # truncated sampling submessage
    b"\xff\xff\xff",  # corrupt wire format
    b"\x0a\xff\xff\xff\xff\x0f",  # length prefix far beyond the message
]


@given(raw=st.one_of(st.sampled_from(RAW_CASES), st.binary(max_size=64)))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_undecodable_requests_get_invalid_argument(stack, raw):
    call = stack.channel.unary_stream(
        "/unicache.v1.Router/Generate",
        request_serializer=lambda b: b,
        response_deserializer=router_pb2.RouterGenerateResponse.FromString,
    )
    try:
        decoded = router_pb2.RouterGenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - the oracle: does the reference parser accept the bytes?
        decoded = None
    try:
        [m async for m in call(raw, metadata=[("x-api-key", "key-acme")], timeout=60)]
        got = OK
    except grpc.aio.AioRpcError as exc:
        got = exc.code()
    COUNTS["raw"] = COUNTS.get("raw", 0) + 1
    if decoded is None:
        assert got == INVALID
    else:  # it parsed: the answer is whatever the same message gets (never a server fault)
        assert got in (OK, INVALID, EXHAUSTED)


@pytest.mark.parametrize(
    "method, response",
    [
        ("/unicache.v1.Router/ListReplicas", router_pb2.ListReplicasResponse),
        ("/unicache.v1.Router/GetClusterState", router_pb2.ClusterState),
    ],
)
async def test_undecodable_unary_calls_get_invalid_argument(stack, method, response):
    call = stack.channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=response.FromString)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(b"\xff\xff\xff", timeout=10)
    assert err.value.code() == INVALID
    assert err.value.details().startswith(f"request is not a valid {method[1:].replace('/', '.')} protobuf message")
    assert isinstance(await call(b"", timeout=10), response)  # the empty message is valid


async def test_replica_answers_undecodable_requests_with_invalid_argument(stack):
    rep = stack.replicas[0]
    async with grpc.aio.insecure_channel(rep.address) as channel:
        call = channel.unary_stream("/unicache.v1.Replica/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in call(b"\x12\x02\xc3\x28", timeout=10)]  # text (field 2) with invalid UTF-8
    assert err.value.code() == INVALID
    assert rep.servicer.request_ids == []  # the servicer never saw it


async def test_message_over_max_request_bytes_is_refused_before_tokenizing(stack):
    limit = stack.app.config.max_request_bytes
    assert limit == 8 << 20  # RouterConfig default, the same as the HTTP body limit
    huge = router_pb2.RouterGenerateRequest(text="q" * limit)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stack.stub.Generate(huge, metadata=[("x-api-key", "key-acme")], timeout=60)]
    assert err.value.code() == EXHAUSTED
    assert stack.served_ids() == []
    ok = router_pb2.RouterGenerateRequest(text="fine", sampling=common_pb2.SamplingParams(max_tokens=1))
    assert len([m async for m in stack.stub.Generate(ok, metadata=[("x-api-key", "key-acme")], timeout=30)]) == 1
