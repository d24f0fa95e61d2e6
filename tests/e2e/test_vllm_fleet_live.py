"""The router in front of stock vLLM OpenAI servers (``--backend``), end to end.

Two ``python -m vllm.entrypoints.openai.api_server`` subprocesses serve the tiny
random-weight Llama the test writes, each with 64 KV blocks of 32 tokens and KV events on
ZMQ: ``uc`` runs UniCache inside vLLM (``--scheduler-cls``), ``native`` is stock vLLM.
Engines start in about a minute on 2 cores; every test here shares them.

Order matters: the session test resets both caches first, the kill test runs last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
import pytest_asyncio

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.contract.tokenizer import load_tokenizer
from unicache.contract.vllm_events import class_to_vllm, salt_to_vllm
from unicache.contract.wire import request_class_to_proto
from unicache.plumbing.redis_server import free_port
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.upstream.vllm_fleet.follower import BackendFollower
from unicache.router.upstream.vllm_fleet.http_stream import BackendUnreachable, VllmClients
from unicache.router.upstream.vllm_fleet.spec import parse_backend
from unicache.testing.polling import eventually
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, start_servers
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BS = 32
POOL_BYTES = 65 * BS * 512  # 65 blocks of 32 tokens of the tiny Llama (512 bytes a token): 64 usable
KEYS = {"UNICACHE_API_KEYS": "ka:acme,kb:beta", "UNICACHE_SALT_SECRET": "fleet-test"}
A = {"authorization": "Bearer ka"}
B = {"authorization": "Bearer kb"}


def text(start: int, n: int, step: int = 1) -> str:
    """n words of the test tokenizer, one token each."""
    return " ".join(WORDS[(start + i * step) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), chat_template=True)


@pytest.fixture(scope="module")
def servers(model_dir):
    uc = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy="unicache")
    native = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy=None)
    start_servers([uc, native])
    try:
        yield {"uc": uc, "native": native}
    finally:
        uc.stop()
        native.stop()


def router_config(model_dir: str, backends: list[str], **overrides):
    return build_config(
        env=KEYS,
        overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "block_size": BS, "served_model_name": "tiny",
            "tokenizer": f"{model_dir}/tokenizer.json", "backends": ";".join(backends), **overrides,
        },
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(servers, model_dir):
    app = RouterApp(router_config(model_dir, [servers["uc"].backend + ",id=uc", servers["native"].backend + ",id=native"]))
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["native", "uc"], "both backends joined", timeout_s=60)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=120) as client:
        yield app, client
    await app.stop()


async def complete(client, prompt, headers, max_tokens: int = 4, **extra):
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    return r.headers["x-unicache-replica"], r.headers["x-unicache-route-reason"], int(r.headers["x-unicache-matched-tokens"]), body


async def settled(app: RouterApp, quiet_s: float = 0.5) -> None:
    """Wait until no event batch reached the router for ``quiet_s``: what the backends
    cached so far is in its index (on a loaded machine the lag can exceed the time between
    a response and the next request, and the exact match assertions need it applied)."""

    def applied() -> int:
        return sum(f.batches for f in app.fleet.followers.values())

    last = -1
    while (now := applied()) != last:
        last = now
        await asyncio.sleep(quiet_s)


# --- UniCache inside stock vLLM ---------------------------------------------------------
async def session_sequence(server: VllmServer, encode) -> tuple[int, int]:
    """tests/replica/test_vllm_engine.py's live-session sequence, sent straight to ``server`` with
    the same classes (``vllm_xargs``) and salt (``cache_salt``): returns the cached prompt
    tokens of the session's two turns."""
    session = RequestClass(tenant="acme", session_id="chat-1", turn=0, task=Task.CHAT)

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
        assert (await c.post("/reset_prefix_cache")).status_code == 200

        async def run(prompt, cls):
            body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                    "cache_salt": salt_to_vllm(b"sess"), "vllm_xargs": {"unicache_class": class_to_vllm(request_class_to_proto(cls))}}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

        turn1 = encode(text(5, 500, 7))
        out1, c1 = await run(turn1, session)
        for k in range(6):
            await run(encode(text(50 + 31 * k, 310, 3 + 2 * k)), RequestClass(tenant="acme"))
        _, c2 = await run(turn1 + out1 + encode(text(90, 30)), RequestClass(tenant="acme", session_id="chat-1", turn=1, task=Task.CHAT))
    return c1, c2


async def test_unicache_inside_vllm_serve_keeps_the_session_as_the_in_process_engine(servers, model_dir):
    tok = load_tokenizer(f"{model_dir}/tokenizer.json")

    def encode(s):
        return list(tok.encode(s, False))

    # The in-process engine's figures (tests/replica/test_vllm_engine.py): UniCache keeps all 15 full
    # prompt blocks of the session, vLLM's LRU 9 of them.
    assert await session_sequence(servers["uc"], encode) == (0, 480)
    assert await session_sequence(servers["native"], encode) == (0, 288)
    # The policy is observable from outside: the plug-in's own port serves the replica's series.
    page = httpx.get(f"http://127.0.0.1:{servers['uc'].metrics_port}/metrics", timeout=10).text
    series = {(f.name, s.labels.get("queue", s.labels.get("state", ""))): s.value
              for f in text_string_to_metric_families(page) for s in f.samples}
    assert series[("unicache_replica_capacity_blocks", "")] == 64
    assert series[("unicache_replica_queue_evictions", "evict_first")] > 0 and series[("unicache_replica_queue_hits", "chat")] > 0
    assert {q for (name, q) in series if name == "unicache_replica_queue_blocks"} >= {"evict_first", "chat", "agent", "structural"}


# --- the router in front of both ------------------------------------------------------
async def test_index_fills_from_events_and_a_repeated_prefix_goes_home(router):
    app, client = router
    prompt = text(3, 200, 5)  # 200 tokens: 6 full blocks
    rid, reason, matched, body = await complete(client, prompt, A)
    assert reason != "index_prefix" and matched == 0 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hashes = hash_token_blocks(app.core.encode(prompt, True), BS, cache_salt=app.auth.cache_salt("acme"))
    await eventually(lambda: app.index.match(rid, hashes) == 6, "the prompt's 6 blocks indexed from the backend's events")
    for _ in range(3):
        await settled(app)
        rid2, reason2, matched2, body2 = await complete(client, prompt, A)
        # NOTE: the classifier takes a repeated prompt for an inferred session, so the reason
        # may be its home; a router without that memory says index_prefix (the two-router test).
        assert (rid2, matched2) == (rid, 192) and reason2 in ("index_prefix", "session_home")
        assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # the index predicted vLLM's hit exactly


async def test_two_tenants_share_no_block(router):
    app, client = router
    prompt = text(11, 160, 3)
    rid, _, _, _ = await complete(client, prompt, A)
    await eventually(lambda: app.index.match(rid, hash_token_blocks(app.core.encode(prompt, True), BS, cache_salt=app.auth.cache_salt("acme"))) == 5, "indexed")
    _, _, matched, body = await complete(client, prompt, B)
    assert matched == 0 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_explicit_session_stays_home_and_chat_hashes_match_vllms(router):
    app, client = router
    history = [{"role": "user", "content": text(40, 120, 3)}]
    homes, cached, matched_all = [], [], []
    for turn in range(4):
        await settled(app)
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "max_tokens": 4, "temperature": 0},
                              headers={**A, "x-session-id": "fleet-chat-1"})
        assert r.status_code == 200, r.text
        homes.append(r.headers["x-unicache-replica"])
        matched_all.append(int(r.headers["x-unicache-matched-tokens"]))
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": text(200 + turn, 40, 7)}]
    assert len(set(homes)) == 1
    # The router's hashes of the rendered chat are the ones vLLM cached: what it expected to
    # hit is what vLLM reports, turn after turn.
    assert matched_all == cached and cached[1] > 0 and cached == sorted(cached)


async def test_evicted_blocks_leave_the_index(router):
    app, client = router
    first = text(7, 300, 11)
    rid, _, _, _ = await complete(client, first, A)
    hashes = hash_token_blocks(app.core.encode(first, True), BS, cache_salt=app.auth.cache_salt("acme"))
    await eventually(lambda: app.index.match(rid, hashes) == 9, "indexed")
    # 12 distinct 300-token prompts sent to the same backend through a one-backend router:
    # 108 blocks through a 64-block pool.
    spec = {"uc": 0, "native": 1}[rid]
    backend = app.backend_specs[spec]
    solo = RouterApp(router_config(app.config.tokenizer.rsplit("/", 1)[0], [f"{backend.url},kv-events={backend.events},replay={backend.replay},id={rid}"]))
    await solo.start()
    try:
        await eventually(lambda: rid in solo.cluster.replicas, "joined")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{solo.http_port}", timeout=120) as c2:
            for k in range(12):
                await complete(c2, text(100 + 13 * k, 300, 17 + 2 * k), B, max_tokens=1)
    finally:
        await solo.stop()
    await eventually(lambda: app.index.match(rid, hashes) < 9, "evicted blocks left the index")
    assert app.index.num_blocks(rid) <= 64
    await settled(app)
    _, _, matched, body = await complete(client, first, A)
    assert matched == body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_second_router_routes_a_prefix_and_a_session_alike(router, model_dir, servers):
    app, client = router
    prompt = text(17, 230, 19)
    home, _, _, _ = await complete(client, prompt, {**A, "x-session-id": "two-routers"})
    port = free_port()
    cmd = [sys.executable, "-m", "unicache.cli.main", "router", "--grpc-port", "0", "--http-port", str(port), "--block-size", str(BS),
           "--tokenizer", f"{model_dir}/tokenizer.json", "--served-model-name", "tiny", "--use-redis", "false",
           "--backend", servers["uc"].backend + ",id=uc", "--backend", servers["native"].backend + ",id=native"]
    proc = subprocess.Popen(cmd, env={**os.environ, **KEYS}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as other:

            async def ready():
                try:
                    return len((await other.get("/v1/cluster/state")).json()["replicas"]) == 2
                except (httpx.HTTPError, ValueError, KeyError):
                    return False

            await eventually(ready, "the second router sees both backends", timeout_s=60)
            # Its followers caught up from each backend's replay buffer when they connected,
            # so it knows what was cached before it started.
            rid, reason, matched, _ = await complete(other, prompt, A)
            assert (rid, reason, matched) == (home, "index_prefix", 224)
            rid, _, _, _ = await complete(other, prompt + " " + text(300, 40), {**A, "x-session-id": "two-routers"})
            assert rid == home
    finally:
        proc.terminate()
        proc.wait(30)


async def test_parameters_the_router_does_not_interpret_reach_vllm_untouched(router):
    app, client = router
    prompt = text(23, 130, 7)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "min_tokens": 6, "ignore_eos": True, "temperature": 0}
    for i in range(2):
        await settled(app)
        r = await client.post("/v1/completions", json=body, headers=A)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 6  # vLLM honoured min_tokens / ignore_eos
        assert r.headers["x-unicache-replica"] in ("uc", "native")
    # The second went where the first left its blocks, and vLLM found them.
    assert int(r.headers["x-unicache-matched-tokens"]) == out["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    stream = {**body, "stream": True}
    async with client.stream("POST", "/v1/completions", json=stream, headers=A) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in r.aiter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    # A passed-through chat is rendered by vLLM itself (the model's chat template): the
    # router's rendering and tokenization hash what vLLM caches.
    chat = {"model": "tiny", "messages": [{"role": "system", "content": text(31, 70, 3)}, {"role": "user", "content": text(90, 50, 11)}],
            "max_tokens": 3, "min_tokens": 3, "temperature": 0}
    for _ in range(2):
        await settled(app)
        r = await client.post("/v1/chat/completions", json=chat, headers=A)
        assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(r.headers["x-unicache-matched-tokens"]) == cached == 96
    # vLLM's own refusal of a bad value comes back as vLLM said it.
    r = await client.post("/v1/completions", json={**body, "min_tokens": -1}, headers=A)
    assert r.status_code == 400 and "min_tokens" in r.text


async def test_a_backend_that_is_not_vllm_is_one_clear_line(router, caplog):
    app, _ = router
    dead = parse_backend(f"http://127.0.0.1:{free_port()},id=dead")
    not_vllm = parse_backend(f"http://127.0.0.1:{app.http_port},id=router")  # our own router: /health 200, no vLLM metrics
    clients = VllmClients()
    try:
        caplog.set_level(logging.WARNING, logger="unicache.router.upstream.vllm_fleet.follower")
        for spec, words in [(dead, "unreachable (cannot connect"), (not_vllm, "not a vLLM")]:
            f = BackendFollower(spec, app.cluster, clients, BS)
            for _ in range(3):
                try:
                    await f.poll_once()
                except BackendUnreachable as exc:
                    f._not_joined(f"unreachable ({exc})")
            assert not f.joined and words in f.problem
            lines = [r.getMessage() for r in caplog.records if spec.backend_id in r.getMessage() and "not routable" in r.getMessage()]
            assert len(lines) == 1, lines  # once, not once per poll
    finally:
        await clients.close()


async def test_the_grpc_door_reaches_vllm_backends(router):
    app, _ = router
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        call = stub.Generate(router_pb2.RouterGenerateRequest(text=text(5, 70, 13), sampling=common_pb2.SamplingParams(max_tokens=3)),
                             metadata=[("authorization", "Bearer ka")], timeout=60)
        msgs = [m async for m in call]
    assert msgs[0].route.replica_id in ("uc", "native")
    assert sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].usage.prompt_tokens == 70


async def test_a_client_that_goes_away_aborts_the_request_at_the_backend(router, servers):
    app, client = router
    body = {"model": "tiny", "prompt": text(9, 60, 3), "max_tokens": 900, "min_tokens": 900, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers=A) as r:
        rid = r.headers["x-unicache-replica"]
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                break  # the first token: then hang up
    url = servers[rid].url

    def running() -> float:
        page = httpx.get(f"{url}/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(page) if f.name == "vllm:num_requests_running" for s in f.samples)

    await eventually(lambda: running() == 0, "vLLM aborted the abandoned request", timeout_s=20, every_s=0.2)
    await eventually(lambda: app.cluster.replicas[rid].in_flight == 0, "the router ended it too")


async def test_one_backend_killed_mid_traffic_fails_no_request(router, servers):
    app, client = router
    prompts = [text(60 + 7 * i, 96, 5) for i in range(16)]
    ok = 0
    for i, prompt in enumerate(prompts):
        if i == 4:
            servers["native"].kill()
        _, _, _, body = await complete(client, prompt, A, max_tokens=2)
        ok += body["choices"][0]["finish_reason"] in ("length", "stop")
    assert ok == len(prompts)
    assert app.cluster.replicas["native"].quarantined
    # Its events stopped with it: after the staleness bound its blocks leave the index.
    await eventually(lambda: app.index.num_blocks("native") == 0, "the dead backend's blocks aged out", timeout_s=30)
