"""Faults against a real cluster on loopback: a private redis-server, three Ray replica
actors (tiny model) and the router in-process (unicache/testing/cluster_harness.py). The
scenarios themselves are unicache/testing/fault_scenarios.py (bench/faults.py runs the same
drivers); these tests assert exact outcomes on the records they return.

One Ray and one replica set for the whole module (starting them dominates the cost);
each test starts its own router and uses prompts no other test sends, and leaves Redis
running and every replica serving. The replica-kill test runs last.
"""

from __future__ import annotations

import grpc
import pytest

from unicache.testing import fault_scenarios as fs
from unicache.testing.cluster_harness import (
    ReplicaSet,
    RouterHandle,
    index_matches_caches,
    locality_first,
    prompt_text,
    start_ray,
    stop_ray,
    wait_for,
)
from unicache.plumbing.redis_server import EmbeddedRedis

pytestmark = pytest.mark.slow
PREFIX = "faults"
BS = 8


@pytest.fixture(scope="module")
def cluster():
    redis = EmbeddedRedis()
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


# ---------------------------------------------------------------------------------------
async def test_redis_outage_serves_on_session_and_load_then_rebuilds(cluster, router_factory):
    redis, replicas = cluster
    router = await router_factory(forward_deadline_s=60)
    rec = await fs.redis_outage(router, redis, replicas)
    log = rec.log

    failed = [(s.phase, s.session, s.reply.code, s.reply.details) for s in log if not s.reply.ok]
    assert failed == []  # zero failed client requests, through the kill and the restart
    reasons = {ph: {s.reply.reason for s in log if s.phase == ph} for ph in ("up", "down", "after")}
    # Redis up: later turns go home, where the index shows their prefix (matched > 0).
    def home_matched(phase: str) -> bool:
        return any(s.reply.reason == "session_home" and s.reply.matched_tokens > 0 for s in log if s.phase == phase)

    assert home_matched("up") and reasons["up"] <= {"session_home", "index_prefix", "load"}
    # Redis down: the index is unusable, sessions stick to their replica, the rest by load.
    assert "session_sticky" in reasons["down"] and reasons["down"] <= {"session_sticky", "load"}
    # Rebuilt: the index vouches for the sessions again.
    assert home_matched("after") and "session_sticky" not in reasons["after"]
    previous: dict[str, str] = {}
    for s in log:
        if s.phase == "down" and s.reply.reason == "session_sticky":
            assert s.reply.replica == previous[s.session]  # stuck where the session's previous turn ran
        previous[s.session] = s.reply.replica
    assert router.app.subscriber.reconnects == 1
    await wait_for(lambda: index_matches_caches(router, replicas), "indexed blocks == every replica's cache", 10, 0.1)


# ---------------------------------------------------------------------------------------
async def test_router_restart_rebuilds_index_and_routes_with_locality_at_once(cluster, router_factory):
    _, replicas = cluster
    # NOTE: long enough that a cached prefix outweighs a replica's (heartbeat) load.
    full_hit = (480 - 1) // BS * BS  # the last prompt token is always computed
    rec = await fs.router_restart(lambda: router_factory(policy_factory=locality_first), replicas, k=6, n=480)

    assert all(r.ok for r in rec.cold + rec.warm)
    assert [r.cached_tokens for r in rec.warm] == [full_hit] * 6
    # Second router: rebuilt from summaries + events alone, then one round.
    assert [(r.code, r.reason, r.cached_tokens) for r in rec.after] == [(grpc.StatusCode.OK, "index_prefix", full_hit)] * 6
    assert [r.replica for r in rec.after] == [r.replica for r in rec.warm]


# ---------------------------------------------------------------------------------------
async def test_stalled_replica_costs_the_derived_timeout_then_is_quarantined(cluster, router_factory):
    _, replicas = cluster
    router = await router_factory(policy_factory=locality_first)
    router.cluster.quarantine_initial_s = 60.0  # no probe while the test runs, however slow the host
    rec = await fs.slow_replica(router, replicas, delay_s=120.0, baseline=5, faulted=2)
    first, second = (t.reply for t in rec.faulted)
    slow, t0 = rec.slow, rec.t_fault
    assert first.ok and second.ok
    assert first.replica != slow and second.replica != slow
    # The first faulted request waited out the derived timeout (its floor: the tiny
    # model's first tokens take milliseconds), not the 60 s ceiling, then went elsewhere.
    assert router.metrics_value("unicache_router_first_token_timeouts_total", replica=slow) == 1
    assert router.app.core.first_token_timeout.floor_s == 5.0
    assert len(router.calls_to(rec.slow_address, t0)) == 1  # tried once, timed out, then quarantined
    assert len([t for t, _ in router.calls if t >= t0]) == 3  # first: slow + retry; second: direct
    assert not router.cluster.healthy(slow)
    assert first.tokens == rec.warm.tokens  # same seeded model everywhere, greedy


# ---------------------------------------------------------------------------------------
async def test_frozen_replica_moves_its_in_flight_requests_within_the_derived_timeout(cluster, router_factory):
    _, replicas = cluster
    router = await router_factory(policy_factory=locality_first)
    rec = await fs.frozen_replica(router, replicas, in_flight=3, freeze_s=8.0, during=3)
    frozen = rec.frozen
    # Derived from the measured first tokens (milliseconds: the floor, or a little above it
    # on a loaded host), far below the 60 s ceiling that applied before anything was measured.
    ftt = router.app.core.first_token_timeout
    assert ftt.floor_s <= rec.timeout_s < ftt.ceiling_s / 10
    # Every request in flight on the frozen process was cancelled there and served elsewhere.
    assert [(t.reply.code, t.reply.replica != frozen) for t in rec.in_flight] == [(grpc.StatusCode.OK, True)] * 3
    assert [(t.reply.code, t.reply.replica != frozen) for t in rec.during] == [(grpc.StatusCode.OK, True)] * 3
    assert rec.calls_while_frozen == []  # quarantined (then its heartbeat expired): never dialled again
    assert rec.timeouts == 3
    # Thawed: back in routing, and serving (a request the router must send to it).
    probe = await router.probe(frozen, prompt_text("frozen-after", 64))
    assert (probe.code, probe.replica) == (grpc.StatusCode.OK, frozen)


# ---------------------------------------------------------------------------------------
async def test_replica_killed_retries_pending_fails_streams_then_rejoins(cluster, router_factory):
    _, replicas = cluster
    router = await router_factory(forward_deadline_s=120, policy_factory=locality_first)
    rec = await fs.replica_kill(router, replicas)
    victim, old, new = rec.victim, rec.old, rec.new

    assert [s.first_replica for s in rec.streams] == [victim] * 2  # both streams under way on the victim
    assert (rec.probe.code, rec.probe.replica, rec.probe.cached_tokens) == (grpc.StatusCode.OK, victim, 0)  # serving, cache empty
    received = [s.messages for s in rec.streams]
    assert all(1 <= n < 100 for n in received), received  # cut short, not completed
    for s in rec.streams:
        assert s.code == grpc.StatusCode.UNAVAILABLE
        assert f"replica {victim} failed after the response started" in s.details
        assert "incomplete" in s.details
    assert [(r.code, r.replica != victim) for r in rec.retried] == [(grpc.StatusCode.OK, True)] * 2
    assert [(r.code, r.details) for _, r in rec.background if not r.ok] == []
    assert new["epoch"] > old["epoch"] and new["address"] != old["address"]
    late = rec.late_calls_s
    # Once the router holds the restarted replica's new address, nothing dials the dead one.
    assert all(dt < rec.rejoined_s for dt in late), late
