"""The whole router process (Redis subscriber, index from sealed summaries, HTTP front door)
in front of 40 in-process replicas: more than ``cache_aware``'s candidate window of 32, so
the live path decides over the window and its kept replicas, and a first block that every
replica holds is grouped (``LocalityIndex.prefix_match_groups``)."""

from __future__ import annotations

import httpx
import redis

from unicache.contract.block_hash import hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY
from tests.e2e.test_router_redis_e2e import publish, shut_down
from tests.router.test_router_subscriber import KEYS

N = 40
PROMPT = "A shared system prompt that is long enough for three blocks."


async def test_a_fleet_past_the_window_routes_to_the_holder_and_keeps_sessions_home(redis_server):
    reps = [FakeReplica(f"r{i:02d}") for i in range(N)]
    for rep in reps:
        await rep.start()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:tenantA", "UNICACHE_SALT_SECRET": "x", "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
        overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis_server.url, "redis_prefix": KEYS.prefix},
    )
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "resync_retry_s": 0.05,
                                            "heartbeat_ttl_s": 60.0})
    hashes = hash_token_blocks(list(PROMPT.encode()), 16, cache_salt=app.auth.cache_salt("tenantA"))
    assert len(hashes) == 3
    # every replica holds the prompt's first block; r37, outside the first requests' windows
    # (r00-r31), holds all three
    holdings = {rep.replica_id: hashes[:1] for rep in reps} | {"r37": hashes}
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    publish(r, reps, holdings)
    await app.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=20, headers={"x-api-key": "k"})
    try:
        await eventually(lambda: len(app.cluster.replicas) == N and app.index.num_blocks("r37") == 3
                         and all(app.index.num_blocks(rep.replica_id) >= 1 for rep in reps), "index of 40 replicas", timeout_s=30)
        deep, groups = app.index.prefix_match_groups(hashes, N // 2)
        assert deep == {"r37": 3} and groups == [(1, {rep.replica_id for rep in reps} - {"r37"})]
        # every decision below takes the large-fleet path (the window, prefixes grouped)
        grouped_walks = []
        walk = app.index.prefix_match_groups
        app.index.prefix_match_groups = lambda h, wide: grouped_walks.append(wide) or walk(h, wide)
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert resp.status_code == 200
        assert resp.headers["x-unicache-replica"] == "r37"
        assert resp.headers["x-unicache-route-reason"] == "index_prefix"
        assert resp.headers["x-unicache-matched-tokens"] == "48"

        # explicit sessions: each later turn (its prompt extends the previous one) goes
        # where the session's first turn went, for sessions started across the fleet
        homes = {}
        for s in range(6):
            text = f"session {s}: a first question that nobody else has asked before"
            for turn in range(3):
                resp = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2},
                                         headers={"x-session-id": f"s{s}"})
                assert resp.status_code == 200
                if turn == 0:
                    homes[s] = resp.headers["x-unicache-replica"]
                else:
                    assert resp.headers["x-unicache-replica"] == homes[s], (s, turn)
                text += f" and then turn {turn + 1} asks a little more"
        assert len(set(homes.values())) > 1  # first turns spread over the fleet
        assert sum(len(rep.served) for rep in reps) == 1 + 6 * 3
        assert grouped_walks == [N // 2] * (1 + 6 * 3)
    finally:
        await shut_down(r, client, app, reps)
