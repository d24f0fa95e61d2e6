"""Explicit sessions stay on their replica, live: two real replicas (tiny model, real
engines, publishers to a private redis-server) behind the router with its default
policy (``cache_aware``). Four sessions of three turns each go through the OpenAI chat
API with ``x-session-id``, one request at a time (turn 1 of every session, then turn 2 of
every session, then turn 3), nothing else running. Every later turn must land on the
replica of its session's first turn and find at least 90% of its prompt cached there.

The sessions start in an order that spreads them (the router places first turns by
load and churn); the assertion is about later turns only, which the index may not have
caught up with (events flush every 20 ms here): stickiness must not depend on it."""

from __future__ import annotations

import httpx
import pytest

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY
from tests.support.real_stack import RealReplica

BS = 16
PREFIX = "sticky"
SESSIONS = 4
TURNS = 3


def system_prompt(s: int) -> str:
    """About 900 bytes, different for every session from the first block on."""
    return f"[session {s}] You are assistant number {s}. " + " ".join(f"rule-{s}-{i}" for i in range(110))


@pytest.fixture
async def router(redis_server):
    reps = [RealReplica(f"r{i}", redis_server.url, PREFIX, block_size=BS, num_blocks=1024, max_position=4096)
            for i in range(2)]
    for r in reps:
        await r.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:acme", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": PREFIX,
                   "block_size": BS, "tokenizer": "byte"},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05})
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["r0", "r1"]
                     and not any(app.index.needs_resync(r) for r in ("r0", "r1")), "replicas in sync")
    try:
        yield app
    finally:
        await app.stop()
        for r in reps:
            await r.stop()


async def test_every_later_turn_of_an_explicit_session_stays_on_its_replica(router):
    assert router.policy.name == "cache_aware"
    history = {s: [{"role": "system", "content": system_prompt(s)}] for s in range(SESSIONS)}
    seen: dict[int, list[tuple[str, str, int, int]]] = {s: [] for s in range(SESSIONS)}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as client:
        for turn in range(TURNS):
            for s in range(SESSIONS):
                history[s].append({"role": "user", "content": f"question {turn} of session {s}?"})
                r = await client.post("/v1/chat/completions", json={"messages": history[s], "max_tokens": 4},
                                      headers={"x-api-key": "k", "x-session-id": f"conv-{s}"})
                assert r.status_code == 200, r.text
                body = r.json()
                usage = body["usage"]
                seen[s].append((r.headers["x-unicache-replica"], r.headers["x-unicache-route-reason"],
                                usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
                history[s].append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    for s, turns in seen.items():
        home = turns[0][0]
        for replica, reason, prompt, cached in turns[1:]:
            assert (replica, reason) == (home, "session_home"), (s, turns)
            assert cached >= 0.9 * prompt, (s, turns)
    # Both replicas got sessions: stickiness did not pile everything on one.
    assert {t[0][0] for t in seen.values()} == {"r0", "r1"}
