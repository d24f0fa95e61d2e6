"""1,000 concurrent streaming requests through the real router to 4 real replicas (the CI
size of bench/load_test.py): every request is answered exactly once, with the tokens a
single reference engine produces for its prompt, and nothing is left behind anywhere.

800 go over gRPC and 200 over HTTP (server-sent events), all at once. Routing is round
robin, so each replica serves exactly 250.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.v1 import common_pb2, router_pb2
from tests.support.load_stack import LoadStack, fast_engine_config

N_GRPC, N_HTTP = 800, 200
MAX_TOKENS = 4
AUTH = [("authorization", "Bearer key-acme")]
FINISH = {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}


def prompt(i: int) -> str:
    # Distinct prompts of 11..47 bytes: the usage's prompt_tokens ties a response to its request.
    return f"load {i:05d} " + "abcdefghijklmnopqrstuvwxyz0123456789"[: i % 37]


def reference(prompts: list[str]) -> list[tuple[list[int], str]]:
    """Greedy tokens and finish reason from one plain engine with the replicas' model and seed."""
    engine = LLMEngine(fast_engine_config())
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), list(p.encode()), SamplingParams(max_tokens=MAX_TOKENS)))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id)].extend(o.new_token_ids)
            if o.finished:
                reasons[int(o.request_id)] = o.finish_reason
    return [(out[i], reasons[i]) for i in range(len(prompts))]


@pytest.fixture
async def stack():
    st = await LoadStack.start(num_replicas=4)
    try:
        yield st
    finally:
        await st.close()


async def grpc_one(st: LoadStack, i: int) -> dict:
    req = router_pb2.RouterGenerateRequest(text=prompt(i), sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    tokens, finishes, routes, usage = [], [], [], None
    async for m in st.stub.Generate(req, metadata=AUTH, timeout=120):
        tokens.extend(m.token_ids)
        if m.finish_reason:
            finishes.append(m.finish_reason)
        if m.HasField("route"):
            routes.append(m.route.replica_id)
        if m.HasField("usage"):
            usage = m.usage
    return {"tokens": tokens, "finishes": finishes, "routes": routes, "prompt_tokens": usage.prompt_tokens, "id": None}


async def http_one(client: httpx.AsyncClient, i: int) -> dict:
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-api-key": "key-acme"}) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    ids = {e["id"] for e in events}
    assert len(ids) == 1
    text_events = [e for e in events if e["choices"]]
    finishes = [e["choices"][0]["finish_reason"] for e in text_events if e["choices"][0]["finish_reason"]]
    return {
        "text": "".join(e["choices"][0]["text"] for e in text_events),
        "finishes": finishes,
        "routes": [r.headers["x-unicache-replica"]],
        "prompt_tokens": events[-1]["usage"]["prompt_tokens"],
        "completion_tokens": events[-1]["usage"]["completion_tokens"],
        "id": ids.pop(),
    }


async def test_1000_concurrent_streams_each_answered_exactly_once(stack):
    n = N_GRPC + N_HTTP
    expected = reference([prompt(i) for i in range(n)])
    limits = httpx.Limits(max_connections=N_HTTP, max_keepalive_connections=N_HTTP)
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(
            *(grpc_one(stack, i) for i in range(N_GRPC)),
            *(http_one(client, i) for i in range(N_GRPC, n)),
        )
    assert len(results) == n
    for i, res in enumerate(results):
        assert res["prompt_tokens"] == len(prompt(i)), i
        assert len(res["routes"]) == 1, i
        tokens, reason = expected[i]  # "length" (4 tokens) or "stop" (greedy hit EOS)
        if i < N_GRPC:
            assert res["tokens"] == tokens, i
            assert res["finishes"] == [FINISH[reason]], i
        else:
            assert res["completion_tokens"] == len(tokens), i
            assert res["text"] == stack.replicas[0].engine.decode(tokens), i
            assert res["finishes"] == [reason], i
    # Every HTTP response carries its own id; every replica call was made exactly once.
    assert len({r["id"] for r in results[N_GRPC:]}) == N_HTTP
    served = stack.served_ids()
    assert len(served) == n and len(set(served)) == n
    assert sorted(len(r.servicer.request_ids) for r in stack.replicas) == [250, 250, 250, 250]
    assert {rid: rec.routed for rid, rec in stack.app.cluster.replicas.items()} == {f"r{k}": 250 for k in range(4)}
    # Nothing left in flight anywhere: router counters, replica streams, KV references.
    assert stack.app.cluster.total_in_flight() == 0
    assert stack.app.metrics.retries._value.get() == 0
    for r in stack.replicas:
        load = r.engine.load()
        assert (load.running, load.waiting) == (0, 0)
    assert stack.referenced_blocks() == [0, 0, 0, 0]
