"""Faults against a real cluster on loopback: a private redis-server, three Ray replica
actors (tiny model) and the router in-process (tests/support/cluster_harness.py).

One Ray and one replica set for the whole module (starting them dominates the cost);
each test starts its own router and uses prompts no other test sends, and leaves Redis
running and every replica serving. The replica-kill test runs last.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.support.cluster_harness import (
    FAST_SUBSCRIBER,
    ReplicaSet,
    RouterHandle,
    index_matches_caches,
    locality_first,
    prompt_hashes,
    prompt_text,
    start_ray,
    stop_ray,
    wait_for,
)
from tests.support.redis_proc import RedisProcess
from unicache.redis_keys import HEARTBEAT_TTL_S

pytestmark = pytest.mark.slow
PREFIX = "faults"
BS = 8


@pytest.fixture(scope="module")
def cluster():
    redis = RedisProcess()
    redis.start()
    tmp = start_ray(num_cpus=4)
    replicas = ReplicaSet(redis.url, PREFIX, num=3)
    try:
        replicas.start()
        yield redis, replicas
    finally:
        try:
            replicas.stop()
        finally:
            stop_ray(tmp)
            redis.close()


@pytest.fixture
async def router_factory(cluster):
    redis, _ = cluster
    if redis.proc is None:  # a failed earlier test must not take the others down with it
        redis.start()
    routers: list[RouterHandle] = []

    async def make(**config) -> RouterHandle:
        r = RouterHandle(redis.url, PREFIX, BS, **config)
        await r.start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        await r.stop()


async def synced(router: RouterHandle, replicas: ReplicaSet) -> None:
    await wait_for(lambda: all(router.in_sync(r) for r in replicas.ids), "router index in sync with every replica")


# ---------------------------------------------------------------------------------------
async def test_redis_outage_serves_on_session_and_load_then_rebuilds(cluster, router_factory):
    redis, replicas = cluster
    router = await router_factory(forward_deadline_s=60)
    await synced(router, replicas)
    sessions = {f"s{i}": prompt_text(f"outage-system-{i}", 48) for i in range(4)}
    phase = "up"
    log: list[tuple[str, str, object]] = []  # (phase, session, reply)
    stop = asyncio.Event()

    async def traffic() -> None:
        turn = 0
        while not stop.is_set():
            for sid in sessions:
                sessions[sid] += f" user turn {turn} of {sid}; assistant reply {turn}."
                sent_in = phase  # the phase when the request was sent, not when it ended
                reply = await router.generate(sessions[sid], max_tokens=4, session_id=sid, task="chat")
                log.append((sent_in, sid, reply))
            turn += 1

    def count(p: str) -> int:
        return sum(1 for ph, _, _ in log if ph == p)

    task = asyncio.create_task(traffic())
    try:
        await wait_for(lambda: count("up") >= 12, "traffic before the outage")
        phase = "killing"
        redis.kill()
        await wait_for(lambda: not router.cluster.redis_connected, "router to notice the outage")
        phase = "down"
        await wait_for(lambda: count("down") >= 12, "traffic during the outage")
        phase = "restarting"
        redis.start()
        t0 = time.monotonic()

        async def rebuilt() -> bool:
            current = {rid: (await replicas.info(rid))["epoch"] for rid in replicas.ids}
            return all(router.in_sync(rid, epoch) for rid, epoch in current.items())

        await wait_for(rebuilt, "index rebuilt at every replica's new epoch", every_s=0.05)
        rebuild_s = time.monotonic() - t0
        phase = "after"
        await wait_for(lambda: count("after") >= 12, "traffic after Redis returned")
    finally:
        stop.set()
        await task

    failed = [(ph, sid, r.code, r.details) for ph, sid, r in log if not r.ok]
    assert failed == []  # zero failed client requests, through the kill and the restart
    reasons = {ph: {r.reason for p, _, r in log if p == ph} for ph in ("up", "down", "after")}
    assert "index_prefix" in reasons["up"]
    # Redis down: the index is unusable, sessions stick to their replica, the rest by load.
    assert "session_sticky" in reasons["down"] and reasons["down"] <= {"session_sticky", "load"}
    assert "index_prefix" in reasons["after"]
    previous: dict[str, str] = {}
    for ph, sid, r in log:
        if ph == "down" and r.reason == "session_sticky":
            assert r.replica == previous[sid]  # stuck where the session's previous turn ran
        previous[sid] = r.replica
    assert router.app.subscriber.reconnects == 1
    await wait_for(lambda: index_matches_caches(router, replicas), "indexed blocks == every replica's cache", 10, 0.1)
    assert rebuild_s < 30


# ---------------------------------------------------------------------------------------
async def test_router_restart_rebuilds_index_and_routes_with_locality_at_once(cluster, router_factory):
    _, replicas = cluster
    # NOTE: long enough that a cached prefix outweighs a replica's (heartbeat) load.
    prompts = [prompt_text(f"restart-{i}", 480) for i in range(6)]
    full_hit = (480 - 1) // BS * BS  # the last prompt token is always computed

    first = await router_factory(policy_factory=locality_first)
    await synced(first, replicas)
    cold = [await first.generate(p) for p in prompts]
    warm = [await first.generate(p) for p in prompts]
    assert all(r.ok for r in cold + warm)
    assert [r.cached_tokens for r in warm] == [full_hit] * 6
    await first.stop()

    second = await router_factory(policy_factory=locality_first)
    await synced(second, replicas)
    # Rebuilt from summaries + events alone (waited for: the last batches may still be in flight).
    await wait_for(lambda: index_matches_caches(second, replicas), "indexed blocks == caches", 10, 0.05)
    after = [await second.generate(p) for p in prompts]
    assert [(r.code, r.reason, r.cached_tokens) for r in after] == [(grpc.StatusCode.OK, "index_prefix", full_hit)] * 6
    assert [r.replica for r in after] == [r.replica for r in warm]


# ---------------------------------------------------------------------------------------
async def test_slow_replica_deadline_fires_and_request_goes_elsewhere(cluster, router_factory):
    _, replicas = cluster
    router = await router_factory(forward_deadline_s=3.0, policy_factory=locality_first)
    router.cluster.down_cooldown_s = 60.0  # keep "skipped" observable however slow the host is
    await synced(router, replicas)
    prompt = prompt_text("slow", 400)
    warm = await router.generate(prompt)
    assert warm.ok
    slow = warm.replica
    slow_addr = router.cluster.replicas[slow].address
    await wait_for(lambda: router.app.index.match(slow, prompt_hashes(router, prompt)) > 0, "prompt indexed on its replica")
    await replicas.set_faults(slow, first_token_delay_s=120.0)
    try:
        t0 = time.monotonic()
        first = await router.generate(prompt)
        second = await router.generate(prompt)
    finally:
        await replicas.set_faults(slow)
    assert first.ok and second.ok
    assert first.replica != slow and second.replica != slow
    assert len(router.calls_to(slow_addr, t0)) == 1  # tried once, deadline, then skipped
    assert len([t for t, _ in router.calls if t >= t0]) == 3  # first: slow + retry; second: direct
    assert first.tokens == warm.tokens  # same seeded model everywhere, greedy


# ---------------------------------------------------------------------------------------
async def test_replica_killed_retries_pending_fails_streams_then_rejoins(cluster, router_factory):
    _, replicas = cluster
    router = await router_factory(forward_deadline_s=120, policy_factory=locality_first)
    await synced(router, replicas)
    base = prompt_text("kill", 800)
    warm = await router.generate(base)
    assert warm.ok
    victim = warm.replica
    old = await replicas.info(victim)
    await wait_for(lambda: router.app.index.match(victim, prompt_hashes(router, base)) > 0, "prompt indexed on the victim")

    # Two streams under way on the victim (slow tokens keep them open), then two requests
    # that reach it but get no token before it dies.
    await replicas.set_faults(victim, token_delay_s=0.2)
    streams = [router.call(base + f" long {i}", max_tokens=100) for i in range(2)]
    for call in streams:
        msg = await call.read()
        assert msg.route.replica_id == victim
    await replicas.set_faults(victim, first_token_delay_s=120.0, token_delay_s=0.2)
    n_before = len(router.calls_to(old["address"]))
    pending = [asyncio.create_task(router.generate(base + f" pending {i}")) for i in range(2)]
    await wait_for(lambda: len(router.calls_to(old["address"])) == n_before + 2, "pending requests at the victim")

    background: list = []
    stop = asyncio.Event()

    async def traffic() -> None:
        i = 0
        while not stop.is_set():
            background.append((time.monotonic(), await router.generate(prompt_text(f"kill-bg-{i}", 64))))
            i += 1

    bg = asyncio.create_task(traffic())
    t_kill = time.monotonic()
    replicas.kill(victim)
    try:
        errors, received = [], []
        for call in streams:
            n = 1  # the first message, read above
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    n += 1
            errors.append(info.value)
            received.append(n)
        retried = await asyncio.gather(*pending)

        async def restarted() -> dict | None:
            try:
                now = await replicas.info(victim, timeout_s=5)
            except Exception:  # noqa: BLE001 - down or restarting
                return None
            return now if now["pid"] != old["pid"] else None

        new = None

        async def rejoined() -> bool:
            nonlocal new
            new = new or await restarted()
            rec = router.cluster.replicas.get(victim)
            return new is not None and rec is not None and rec.address == new["address"] and router.in_sync(victim, new["epoch"])

        await wait_for(rejoined, "the victim restarted by Ray and back in the router", 120, 0.1)
    finally:
        stop.set()
        await bg
    probe = await router.probe(victim, prompt_text("kill-probe", 64))
    assert (probe.code, probe.replica, probe.cached_tokens) == (grpc.StatusCode.OK, victim, 0)  # serving, cache empty

    assert all(1 <= n < 100 for n in received), received  # cut short, not completed
    for exc in errors:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert f"replica {victim} failed after the response started" in exc.details()
        assert "incomplete" in exc.details()
    assert [(r.code, r.replica != victim) for r in retried] == [(grpc.StatusCode.OK, True)] * 2
    assert [(r.code, r.details) for _, r in background if not r.ok] == []
    assert new["epoch"] > old["epoch"] and new["address"] != old["address"]
    late = [t - t_kill for t in router.calls_to(old["address"], t_kill)]
    # Within the heartbeat expiry (plus one subscriber scan) nothing dials the dead address.
    assert all(dt <= HEARTBEAT_TTL_S + FAST_SUBSCRIBER["heartbeat_interval_s"] + 0.5 for dt in late), late
