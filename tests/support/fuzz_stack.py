"""The fuzz tests' stack: two replicas behind a router (``LoadStack``), checked after each test.

``tests/router/test_fuzz_grpc.py`` and ``tests/router/test_fuzz_http.py`` fuzz the two client APIs of the
same stack and end with the same check: no KV block is referenced on any replica, every
replica still serves (one request per replica through the API under test: the router
routes round robin) and nothing is in flight at the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from unicache.v1 import common_pb2, router_pb2
from tests.support.load_stack import LoadStack

NUM_REPLICAS = 2


async def serves_over_grpc(stack: LoadStack) -> None:
    """One 2-token gRPC Generate per replica, each answered in full."""
    req = router_pb2.RouterGenerateRequest(text="still alive", sampling=common_pb2.SamplingParams(max_tokens=2))
    for _ in stack.replicas:
        msgs = [m async for m in stack.stub.Generate(req, metadata=[("x-api-key", "key-acme")], timeout=30)]
        assert sum(len(m.token_ids) for m in msgs) == 2


async def serves_over_http(stack: LoadStack) -> None:
    """One 2-token greedy ``/v1/completions`` per replica, each a 200 with 2 completion tokens
    (greedy: OpenAI's default temperature 1 may sample the EOS and stop after one)."""
    import httpx

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=30) as client:
        for _ in stack.replicas:
            r = await client.post("/v1/completions", json={"prompt": "alive", "max_tokens": 2, "temperature": 0}, headers={"x-api-key": "key-acme"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def settled(stack: LoadStack, still_serves: Callable[[LoadStack], Awaitable[None]]) -> None:
    """After a run: no replica holds a referenced KV block (polled for up to about 5 s),
    ``still_serves`` passes, and nothing is in flight."""
    idle = [0] * len(stack.replicas)
    for _ in range(500):
        if stack.referenced_blocks() == idle:
            break
        await asyncio.sleep(0.01)
    assert stack.referenced_blocks() == idle
    await still_serves(stack)
    assert stack.app.cluster.total_in_flight() == 0


def stack_fixture(still_serves: Callable[[LoadStack], Awaitable[None]], summary: Callable[[], str]):
    """A function-scoped ``stack`` fixture: a fresh ``LoadStack`` of two replicas, ``settled``
    with ``still_serves`` after the test, ``summary()`` printed, then closed.

    Use as ``stack = stack_fixture(serves_over_grpc, lambda: ...)`` in a test module."""

    @pytest.fixture
    async def stack():
        st_ = await LoadStack.start(num_replicas=NUM_REPLICAS)
        try:
            yield st_
            await settled(st_, still_serves)
            print(summary())
        finally:
            await st_.close()

    return stack
