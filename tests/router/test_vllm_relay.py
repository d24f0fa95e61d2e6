"""An HTTP client's request relayed to a vLLM backend through the one request path
(router/request_path/core.py with router/upstream/vllm_fleet/relay.py): vLLM's own bytes
back with the router's headers, vLLM's own errors back as vLLM said them, refusals,
stalls and deaths handled as for any replica, the client leaving closing the backend's
connection; the gRPC door and a batch of prompts still read vLLM as messages.

The vLLM backends are unicache/testing/fake_vllm.py servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import httpx

from unicache.contract.vllm_events import EXTRA_ARGS_KEY, salt_to_vllm
from unicache.router.app import RouterApp
from unicache.router.upstream.vllm_fleet.relay import RelayRequest, VllmRelay, relay_body
from unicache.router.upstream.vllm_fleet.http_pool import HttpPool
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.fake_vllm import VLLM_ERROR, FakeVllm, model_card
from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.support.router_stack import config

KEY = {"x-api-key": "key-a"}
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen"


@contextlib.asynccontextmanager
async def fleet(n: int = 1, replicas: list[FakeReplica] = (), **overrides):
    """(app, the fake vLLM servers v0.., an HTTP client of the router's door)."""
    fakes = [await FakeVllm([model_card("model-0")], cached_tokens=16).start() for _ in range(n)]
    for r in replicas:
        await r.start()
    backends = ";".join(f"{f.url},id=v{i}" for i, f in enumerate(fakes))
    app = RouterApp(config(list(replicas), backends=backends, **overrides))
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        want = sorted([f"v{i}" for i in range(n)] + [r.replica_id for r in replicas])
        await eventually(lambda: sorted(app.cluster.replicas) == want, "the backends joined")
        yield app, fakes, client
    finally:
        await client.aclose()
        await app.stop()
        for f in fakes:
            await f.stop()
        for r in replicas:
            await r.stop()


async def straight(fake: FakeVllm, path: str, body: dict) -> bytes:
    """What ``fake`` answers to ``body`` sent straight to it."""
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as c:
        r = await c.post(path, json=body)
        fake.bodies.pop()
        fake.paths.pop()
        return r.content


def sample(app: RouterApp, name: str, **labels) -> float | None:
    return app.metrics.registry.get_sample_value(name, labels)


async def test_the_client_gets_vllms_own_events_with_the_routers_headers():
    async with fleet() as (app, (fake,), client):
        body = {"model": "unicache-default", "prompt": PROMPT, "max_tokens": 3, "stream": True}
        r = await client.post("/v1/completions", json=body, headers=KEY)
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert (r.headers["x-unicache-replica"], r.headers["x-unicache-matched-tokens"]) == ("v0", "0")
        sent = fake.bodies[-1]
        # What vLLM got: the client's body, the model renamed to the one it serves, the tenant's
        # salt, the request class, and the usage chunk asked for (the router's metrics need it).
        assert sent["prompt"] == PROMPT and sent["model"] == "model-0" and sent["max_tokens"] == 3
        assert sent["cache_salt"] == salt_to_vllm(app.auth.cache_salt("tenantA"))
        assert set(sent["vllm_xargs"]) == {EXTRA_ARGS_KEY} and sent["stream_options"] == {"include_usage": True}
        own = await straight(fake, "/v1/completions", sent)
        usage_event = own.split(b"\n\n")[-3] + b"\n\n"
        assert b'"usage":{' in usage_event
        # The client did not ask for usage: vLLM's bytes without that one event.
        assert r.content == own.replace(usage_event, b"")
        assert sample(app, "unicache_router_cached_tokens_total", replica="v0") == 16
        # A client that asks for usage gets vLLM's events byte for byte.
        r = await client.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}, headers=KEY)
        assert r.content == await straight(fake, "/v1/completions", fake.bodies[-1])
        assert sample(app, "unicache_router_cached_tokens_total", replica="v0") == 32
        assert sample(app, "unicache_router_requests_total", api="completions", outcome="ok") == 2


async def test_an_unstreamed_answer_and_a_chat_are_vllms_own_bodies():
    async with fleet() as (app, (fake,), client):
        body = {"prompt": PROMPT, "max_tokens": 2}
        r = await client.post("/v1/completions", json=body, headers=KEY)
        assert r.status_code == 200 and r.headers["x-unicache-replica"] == "v0"
        assert r.content == await straight(fake, "/v1/completions", fake.bodies[-1])
        assert "stream_options" not in fake.bodies[-1]
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "stream": True}
        r = await client.post("/v1/chat/completions", json=chat, headers=KEY)
        assert fake.paths[-1] == "/v1/chat/completions" and fake.bodies[-1]["messages"] == chat["messages"]
        assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in r.text.split("\n\n")[:2]] == [" w0", " w1"]
        assert r.text.endswith("data: [DONE]\n\n")


async def test_vllms_refusal_of_a_request_is_passed_on_as_vllm_said_it():
    async with fleet(2) as (app, fakes, client):
        for f in fakes:
            f.mode = "invalid"
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "min_tokens": -1}, headers=KEY)
        assert (r.status_code, r.json()) == (400, VLLM_ERROR), r.text
        # The request's fault: not retried elsewhere, nobody quarantined.
        assert sum(len(f.bodies) for f in fakes) == 1 and all(app.cluster.healthy(f"v{i}") for i in range(2))
        assert sample(app, "unicache_router_requests_total", api="completions", outcome="invalid") == 1


async def test_a_refusing_backend_is_quarantined_and_another_serves():
    async with fleet(2) as (app, fakes, client):
        fakes[0].mode = "refuse"
        for _ in range(2):
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "stream": True}, headers=KEY)
            assert r.status_code == 200 and r.headers["x-unicache-replica"] == "v1"
        assert not app.cluster.healthy("v0") and app.cluster.healthy("v1")
        assert sample(app, "unicache_router_quarantines_total", replica="v0") == 1
        assert app.cluster.replicas["v0"].in_flight == app.cluster.replicas["v1"].in_flight == 0
        # the refused attempts and the served ones left no queued prompt tokens behind
        assert app.cluster.replicas["v0"].load.queued_prefill_tokens == app.cluster.replicas["v1"].load.queued_prefill_tokens == 0
        # Every backend refuses: the router's own 503, naming no address.
        fakes[1].mode = "refuse"
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=KEY)
        assert (r.status_code, r.json()["error"]["message"]) == (503, "replica unavailable")
        assert all(str(f.port) not in r.text for f in fakes)


async def test_a_stalled_backend_is_cut_at_its_first_token_timeout_and_another_serves():
    async with fleet(2, first_token_timeout_s=1.0, first_token_timeout_floor_s=0.1) as (app, fakes, client):
        fakes[0].mode = "stall"
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "stream": True}, headers=KEY)
        assert r.status_code == 200 and r.headers["x-unicache-replica"] == "v1"
        assert len(fakes[0].bodies) == 1 and not app.cluster.healthy("v0")
        assert sample(app, "unicache_router_first_token_timeouts_total", replica="v0") == 1
        assert app.cluster.replicas["v0"].load.queued_prefill_tokens == app.cluster.replicas["v1"].load.queued_prefill_tokens == 0


async def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_event():
    async with fleet(1) as (app, (fake,), client):
        fake.mode = "die"
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}, headers=KEY)
        events = r.text.split("\n\n")
        assert r.status_code == 200 and json.loads(events[0][6:])["choices"][0]["text"] == " w0"
        assert json.loads(events[1][6:])["error"]["code"] == "service_unavailable" and events[2] == "data: [DONE]"
        assert "failed after the response started" in json.loads(events[1][6:])["error"]["message"]
        assert not app.cluster.healthy("v0") and app.cluster.replicas["v0"].in_flight == 0


async def test_a_client_leaving_closes_the_backends_connection():
    async with fleet(1) as (app, (fake,), client):
        fake.token_delay_s = 0.02
        body = {"prompt": PROMPT, "max_tokens": 500, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=KEY) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # the first token: then hang up
        await eventually(lambda: fake.disconnected == 1, "the backend saw the router hang up")
        await eventually(lambda: app.cluster.replicas["v0"].in_flight == 0, "the router ended the request")
        assert app.cluster.replicas["v0"].load.queued_prefill_tokens == 0


async def test_parameters_only_vllm_interprets_go_only_to_vllm_backends():
    async with fleet(1, replicas=[FakeReplica("solo")]) as (app, (fake,), client):
        for _ in range(3):
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "min_tokens": 1}, headers=KEY)
            assert r.status_code == 200 and r.headers["x-unicache-replica"] == "v0"
        assert [b["min_tokens"] for b in fake.bodies] == [1, 1, 1]
        # A request the router reads goes to either kind (round robin): the replica answers in messages.
        seen = set()
        for _ in range(2):
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=KEY)
            assert r.status_code == 200
            seen.add(r.headers["x-unicache-replica"])
        assert seen == {"v0", "solo"}


async def test_the_grpc_door_and_a_batch_read_vllm_as_messages():
    async with fleet(1) as (app, (fake,), client):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=3)),
                metadata=[("x-api-key", "key-a")], timeout=10)
            msgs = [m async for m in call]
        assert msgs[0].route.replica_id == "v0" and [list(m.token_ids) for m in msgs if m.token_ids] == [[100], [101], [102]]
        assert msgs[-1].usage.cached_tokens == 16 and fake.paths[-1] == "/v1/completions"
        assert isinstance(fake.bodies[-1]["prompt"], list)  # the token ids the router hashed
        r = await client.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 2}, headers=KEY)
        assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == [" w0 w1", " w0 w1"]


async def test_a_usage_event_cut_by_a_read_is_still_cut_out_and_counted():
    req = RelayRequest("/v1/completions", {"prompt": "x", "stream": True}, stream=True)
    relay = VllmRelay(HttpPool("http://127.0.0.1:1"), req, b"{}", 10)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
    token = b'data: {"choices":[{"text":"a"}]}\n\n'
    # Cut inside the event, and inside the word "usage" itself.
    for cut in (30, usage.index(b'"usage"') + 3):
        out = [relay._scan(token + usage[:cut]), relay._scan(usage[cut:] + b"data: [DONE]\n\n")]
        assert out == [token, b"data: [DONE]\n\n"]
    assert relay.usage == {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    assert json.loads(relay_body(req, "m", b"", common_pb2.RequestClass()))["stream_options"] == {"include_usage": True}


async def test_the_deadline_ends_a_relayed_stream_and_the_backends_request():
    async with fleet(1, forward_deadline_s=1.5) as (app, (fake,), client):
        fake.token_delay_s = 0.2
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "stream": True}, headers=KEY)
        events = r.text.split("\n\n")
        assert r.status_code == 200 and events[-1] == ""  # the body ends with a whole event
        error = json.loads(events[-3][6:])["error"]
        assert error["code"] == "timeout" and "failed after the response started (deadline)" in error["message"]
        assert 1 <= len(events) - 3 <= 8 and events[-2] == "data: [DONE]"
        await eventually(lambda: fake.disconnected == 1, "the backend saw the router hang up")
        assert app.cluster.healthy("v0")  # a slow answer is not a dead backend


async def test_the_fake_vllm_answers_a_line_that_is_not_http_with_400_and_closes():
    """A peer router's bare probe (no request line) gets vLLM's 400, not a server traceback."""
    fake = await FakeVllm([model_card("m")]).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", fake.port)
        writer.write(b"\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and answer.endswith(b"Invalid HTTP request received.")
    finally:
        await fake.stop()
