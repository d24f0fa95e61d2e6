"""A backend that gets slower draws a smaller share of new requests, live: two stock vLLM
servers (the tiny random-weight Llama, one core each) behind the router with its default
policy (``cache_aware``, priced by the live cost model). After a warm-up in which both
backends are fitted, one server's engine is throttled (its processes other than the API
server stopped 9/10 of the time, SIGSTOP / SIGCONT) while four clients keep sending
prompts that share nothing; after the next 16 answers the throttled backend gets a
smaller share of the new requests than the other; while it is throttled the model prices
it above the other at some point (a request held there past its prediction's noise:
``CostModel.set_overdue``), and it never prices it below the other. (That its fitted
speed says so once it has answered 16 requests under the throttle is the unit test's,
tests/router/test_cost_model.py: here the throttled server, steered away by the requests
it holds, answered 10 of 240 requests on a machine half as fast, too few for its speed to
be judged.)

No timing is asserted: only which backend each request went to, and the fitted costs'
order."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.procfs import child_pids
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, start_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BS = 32
POOL_BYTES = 129 * BS * 512  # 128 usable blocks of 32 tokens of the tiny Llama
CLIENTS = 4


def prompt(i: int) -> str:
    """About 160 tokens, different from the first token on."""
    return " ".join(WORDS[(i * 7919 + k * 31) % len(WORDS)] for k in range(160))


def engine_pids(server: VllmServer) -> list[int]:
    """The server's descendant processes (vLLM's engine core), not its API server."""
    out, todo = [], child_pids(server.proc.pid)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(child_pids(pid))
    return out


async def throttle(pids: list[int], stop: asyncio.Event) -> None:
    """Stop ``pids`` 90% of the time until ``stop`` is set, then let them run."""
    try:
        while not stop.is_set():
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(0.45)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.05)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


async def send(client: httpx.AsyncClient, numbers: list[int], out: list[tuple[int, str]]) -> None:
    """``CLIENTS`` clients send the prompts numbered ``numbers`` one after another each,
    streamed (a request waiting for its first token is what prices a backend that holds
    it); ``out`` gets (number, backend) in the order the answers came."""
    queue = list(numbers)

    async def one_client() -> None:
        while queue:
            i = queue.pop(0)
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt(i), "max_tokens": 4,
                                                           "temperature": 0, "stream": True}, headers={"authorization": "Bearer k"})
            assert r.status_code == 200, r.text
            out.append((i, r.headers["x-unicache-replica"]))

    await asyncio.gather(*(one_client() for _ in range(CLIENTS)))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), chat_template=True)
    fast = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy=None)
    slow = VllmServer(model_dir, kv_cache_bytes=POOL_BYTES, eviction_policy=None)
    start_servers([fast, slow])
    try:
        yield model_dir, fast, slow
    finally:
        fast.stop()
        slow.stop()


async def test_a_throttled_backend_draws_fewer_new_requests(servers):
    model_dir, fast, slow = servers
    cfg = build_config(env={"UNICACHE_API_KEYS": "k:acme", "UNICACHE_SALT_SECRET": "cost-test"}, overrides={
        "grpc_port": 0, "http_port": 0, "use_redis": False, "block_size": BS, "served_model_name": "tiny",
        "tokenizer": f"{model_dir}/tokenizer.json", "backends": f"{fast.backend},id=a;{slow.backend},id=b"})
    app = RouterApp(cfg)
    await app.start()
    try:
        await eventually(lambda: sorted(app.cluster.replicas) == ["a", "b"], "both backends joined", timeout_s=60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=120) as client:
            warm: list[tuple[int, str]] = []
            model = app.cluster.cost_model
            # NOTE: warm up until both backends are fitted (at most 4 batches): in a full CI run
            # one backend had no observation after the first 48 requests.
            for batch in range(4):
                await send(client, list(range(48 * batch, 48 * (batch + 1))), warm)
                if model.costs("a").fitted and model.costs("b").fitted:
                    break
            assert model.costs("a").fitted and model.costs("b").fitted, model.snapshot()
            assert {b for _, b in warm} == {"a", "b"}
            stop = asyncio.Event()
            throttler = asyncio.create_task(throttle(engine_pids(slow), stop))
            ratios: list[float] = []  # b's price over a's while b is throttled

            async def watch() -> None:
                while not stop.is_set():
                    ratios.append(model.costs("b").ttft_s(160, 0, 1) / model.costs("a").ttft_s(160, 0, 1))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                throttled: list[tuple[int, str]] = []
                await send(client, list(range(1000, 1048)), throttled)
            finally:
                stop.set()
                await throttler
                await watcher
        later = [b for _, b in throttled[16:]]
        share_b = later.count("b") / len(later)
        assert share_b < 0.5, (share_b, throttled, model.snapshot())
        assert max(ratios) > 1.0, (ratios, model.snapshot())
        # the time b was priced overdue is counted in the router's metrics
        overdue_b = app.metrics.registry.get_sample_value("unicache_router_backend_overdue_seconds_total", {"replica": "b"})
        assert overdue_b is not None and overdue_b > 0.0, model.snapshot()
        a, b = model.costs("a"), model.costs("b")
        assert b.ttft_s(160, 0, 1) >= a.ttft_s(160, 0, 1), model.snapshot()
    finally:
        await app.stop()
