"""A chat's next turn sent right after its first finds the first turn's replica, live,
before any event of that turn reached the router: two real replicas (tiny model, real
engines) whose publishers flush their events only every 30 s, behind the router with its
default policy (``cache_aware``); no session id, so only what the router knows of the
first turn's blocks can place the second. Then the same right after a Redis restart,
while the router's index is empty or resyncing.

The router records a routed request's blocks as pending on its replica at dispatch
(router/cluster/pending.py); without that the second turn is placed by load alone."""

from __future__ import annotations

import httpx
import pytest

from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY
from tests.support.real_stack import RealReplica

BS = 16
PREFIX = "nextturn"


def system_prompt(tag: str) -> str:
    """About 700 bytes, different for every conversation from the first block on."""
    return f"[{tag}] You are a careful assistant. " + " ".join(f"rule-{tag}-{i}" for i in range(80))


@pytest.fixture
async def stack(redis_server):
    reps = [RealReplica(f"r{i}", redis_server.url, PREFIX, block_size=BS, num_blocks=1024, max_position=4096,
                        flush_interval_s=30.0) for i in range(2)]
    for r in reps:
        await r.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:acme", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": PREFIX,
                   "block_size": BS, "tokenizer": "byte"},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05,
                                            "backoff_initial_s": 0.02, "backoff_max_s": 0.1, "reconnect_grace_s": 30.0})
    await app.start()
    await eventually(lambda: sorted(app.cluster.replicas) == ["r0", "r1"]
                     and not any(app.index.needs_resync(r) for r in ("r0", "r1")), "replicas in sync")
    try:
        yield app, redis_server
    finally:
        await app.stop()
        for r in reps:
            await r.stop()


async def two_turns(client: httpx.AsyncClient, tag: str) -> list[tuple[str, str, int, int]]:
    """Turn 1, then turn 2 (turn 1's messages, its answer and a new question) at once."""
    messages = [{"role": "system", "content": system_prompt(tag)}, {"role": "user", "content": "first question?"}]
    out = []
    for turn in range(2):
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4},
                              headers={"x-api-key": "k"})
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        out.append((r.headers["x-unicache-replica"], r.headers["x-unicache-route-reason"],
                    usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and a second question?"}]
    return out


def assert_followed(turns: list[tuple[str, str, int, int]]) -> None:
    (home, _, first_prompt, _), (replica, reason, _, cached) = turns
    assert replica == home, turns
    assert reason in ("index_prefix", "session_home"), turns
    assert cached >= (first_prompt // BS - 1) * BS, turns  # the first turn's full blocks (the last may differ)


async def test_a_next_turn_finds_its_home_before_any_event_and_after_a_redis_restart(stack):
    app, redis_server = stack
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=60) as client:
        turns = await two_turns(client, "fresh")
        assert app.index.num_blocks(turns[0][0]) == 0  # no event of the first turn reached the router
        assert_followed(turns)

        redis_server.kill()
        await eventually(lambda: not app.cluster.redis_connected, "the router to notice the outage")
        redis_server.start()
        await eventually(lambda: app.cluster.redis_connected, "the router to reconnect")
        turns = await two_turns(client, "restarted")
        assert_followed(turns)
