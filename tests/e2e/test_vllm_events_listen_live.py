"""``--kv-events-listen``: two stock vLLM servers publish their KV events to the router's one
bound socket (their ``--kv-events-config`` endpoint is the router's address, so vLLM
connects), end to end.

Server ``a`` publishes on topic ``vllm-a``, its backend id (our convention); server ``b`` on
llm-d's ``kv@127.0.0.1@tiny`` (given as ``kv-topic=``: both servers share the loopback
address, so the topic's address alone could not tell them apart). Each serves one prompt
before the router starts: the router learns those blocks from the servers' replay sockets.
"""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from tests.e2e.test_vllm_fleet_live import text

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.tokenizer import load_tokenizer
from unicache.plumbing.redis_server import free_port
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.upstream.vllm_fleet.events_listener import TopicStream
from unicache.testing.polling import eventually
from unicache.testing.tiny_hf_model import write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, start_servers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BS = 32
POOL_BYTES = 65 * BS * 512  # 64 usable blocks of the tiny Llama
KEYS = {"UNICACHE_API_KEYS": "ka:acme", "UNICACHE_SALT_SECRET": "listen-test"}
A = {"authorization": "Bearer ka"}
LLMD_TOPIC = "kv@127.0.0.1@tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), chat_template=True)


@pytest.fixture(scope="module")
def listen_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def servers(model_dir, listen_port):
    endpoint = f"tcp://127.0.0.1:{listen_port}"  # a host address: vLLM connects to the router
    a = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy=None, events_endpoint=endpoint, events_topic="vllm-a")
    b = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy=None, events_endpoint=endpoint, events_topic=LLMD_TOPIC)
    start_servers([a, b])
    try:
        yield {"a": a, "b": b}
    finally:
        a.stop()
        b.stop()


def direct(server: VllmServer, prompt: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(servers, model_dir, listen_port):
    # before the router listens: what the servers publish now only their replay buffers keep
    direct(servers["a"], text(0, 100))
    direct(servers["b"], text(7, 70, 3))
    a, b = servers["a"], servers["b"]
    config = build_config(env=KEYS, overrides={
        "grpc_port": 0, "http_port": 0, "use_redis": False, "block_size": BS, "served_model_name": "tiny",
        "tokenizer": f"{model_dir}/tokenizer.json", "kv_events_listen": f"tcp://127.0.0.1:{listen_port}",
        "backends": f"{a.url},id=vllm-a,replay=tcp://127.0.0.1:{a.replay_port};"
                    f"{b.url},id=vllm-b,kv-topic={LLMD_TOPIC},replay=tcp://127.0.0.1:{b.replay_port}",
    })
    app = RouterApp(config)
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["vllm-a", "vllm-b"], "both backends joined", timeout_s=120)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=120) as client:
        yield app, client
    await app.stop()


async def test_both_servers_publish_to_one_socket_and_their_history_is_replayed(router, model_dir):
    app, client = router
    followers = app.fleet.followers
    assert {rid: type(f.subscriber) for rid, f in followers.items()} == {"vllm-a": TopicStream, "vllm-b": TopicStream}
    tok = load_tokenizer(f"{model_dir}/tokenizer.json")
    seen_a = hash_token_blocks(list(tok.encode(text(0, 100), True)), BS)  # sent without a salt: unsalted
    seen_b = hash_token_blocks(list(tok.encode(text(7, 70, 3), True)), BS)
    # caught up from each server's replay socket: the blocks of the prompt it served before
    await eventually(lambda: app.index.match("vllm-a", seen_a) == len(seen_a) == 3, "a's replayed blocks indexed")
    await eventually(lambda: app.index.match("vllm-b", seen_b) == len(seen_b) == 2, "b's replayed blocks indexed")
    assert (app.index.match("vllm-b", seen_a), app.index.match("vllm-a", seen_b)) == (0, 0)
    state = (await client.get("/v1/cluster/state")).json()
    assert {r["info"]["replica_id"]: r["info"]["kv_events_schema"] for r in state["replicas"]} == {"vllm-a": "map", "vllm-b": "map"}
    assert app.fleet.followers["vllm-a"].subscriber.replayed >= 1 and app.events_listener.unclaimed == {}


async def test_live_events_on_the_listener_route_a_repeated_prefix_home(router):
    app, client = router
    prompt = text(5, 200, 7)  # 200 tokens: 6 full blocks
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}, headers=A)
    assert r.status_code == 200, r.text
    home = r.headers["x-unicache-replica"]
    hashes = hash_token_blocks(app.core.encode(prompt, True), BS, cache_salt=app.auth.cache_salt("acme"))
    await eventually(lambda: app.index.match(home, hashes) == 6, "the prompt's 6 blocks indexed from events on the listener")
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}, headers=A)
    assert (r.headers["x-unicache-replica"], int(r.headers["x-unicache-matched-tokens"])) == (home, 192)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
