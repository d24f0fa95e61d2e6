"""The four fault scenarios, driven once against a live cluster, each returning a record.

``tests/e2e/test_fault_cluster.py`` asserts exact outcomes on these records and
``bench/faults.py`` computes its figures from them, so the test and the benchmark
exercise the very same sequence of requests and faults. The cluster pieces come from
``unicache/testing/cluster_harness.py``.

Scenarios (what each driver does, in order):

    redis_outage    session traffic; kill redis-server; traffic while it is down; restart
                    it on the same port; wait until the router's index is rebuilt; traffic
                    after.
    replica_kill    two streams under way on the replica that holds a prompt, two requests
                    waiting there for their first token, background traffic; kill the actor
                    (Ray restarts it); wait until the restarted actor is back in the router;
                    one probe request that must go to it.
    router_restart  a repeating workload through one router, stop it, start a new one and
                    send the same prompts again.
    slow_replica    the replica that holds a prompt stops answering (first-token delay);
                    requests for that prompt go on.
    frozen_replica  requests in flight on the replica that holds a prompt when its process
                    is frozen (SIGSTOP); requests for the prompt go on during the freeze;
                    the process resumes (SIGCONT) and the router takes it back.
    concurrent      many streaming requests at once through the router.

Invariants:
    * A driver never stops a router it was given; it stops every router it makes
      (``router_restart``), also when it fails.
    * Faults a driver sets are cleared before it returns (Redis running again, first-token
      delays reset), unless a wait it needs times out.
    * Times are ``time.monotonic()`` seconds; every wait has a deadline and names what it
      waited for when that passes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from unicache.testing.cluster_harness import (
    ReplicaSet,
    Reply,
    RouterHandle,
    epochs,
    index_matches_caches,
    prompt_hashes,
    prompt_text,
    wait_for,
)


async def synced(router: RouterHandle, replicas: ReplicaSet, timeout_s: float = 30.0) -> None:
    """Wait until the router's index follows every replica (summary applied, no gap)."""
    await wait_for(lambda: all(router.in_sync(r) for r in replicas.ids), "router index in sync with every replica", timeout_s)


async def first_reply(router: RouterHandle, prompt: str) -> Reply:
    """Send ``prompt`` once; raises AssertionError if it fails (every scenario that warms a
    replica up needs the one the prompt landed on)."""
    warm = await router.generate(prompt)
    if not warm.ok:
        raise AssertionError(f"warm-up request failed: {warm.code.name} {warm.details}")
    return warm


async def indexed_on(router: RouterHandle, rid: str, prompt: str, what: str, timeout_s: float) -> None:
    """Wait until the router's index shows part of ``prompt`` on ``rid``."""
    await wait_for(lambda: router.app.index.match(rid, prompt_hashes(router, prompt)) > 0, what, timeout_s)


# ------------------------------------------------------------------------------- redis
@dataclass(slots=True)
class Sent:
    """One request of the session traffic: the phase it was sent and answered in, or
    ``"<sent>-><answered>"`` when the phase changed while it was in flight (its route may
    have been chosen on either side: a session turn's placement is read from Redis before
    the choice, so a turn sent just before the kill can be routed just after it)."""

    phase: str
    session: str
    reply: Reply


@dataclass(slots=True)
class OutageRecord:
    """What happened in ``redis_outage``.

    Attributes:
        log: every request in send order; phases ``up``, ``killing``, ``down``,
            ``restarting`` (live restart only) and ``after``, or ``a->b`` for a request
            in flight while the phase went from a to b.
        noticed_s: kill -> the router saw Redis down.
        reconnect_s: restart -> the router reconnected.
        rebuilt_s: restart -> index rebuilt (criterion: see ``redis_outage``).
    """

    log: list[Sent]
    noticed_s: float
    reconnect_s: float
    rebuilt_s: float


class _SessionTraffic:
    """Rounds of one new turn per session, sequential, until stopped; each request is logged
    with the phase current when it was sent. A stop ends the current round first."""

    def __init__(self, router: RouterHandle, sessions: dict[str, str], log: list[Sent]):
        self.router, self.sessions, self.log = router, sessions, log
        self.phase = "up"
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            task, self._task = self._task, None
            await task

    def count(self, phase: str) -> int:
        return sum(1 for s in self.log if s.phase == phase)

    async def _run(self) -> None:
        turn = 0
        while not self._stop.is_set():
            for sid in self.sessions:
                self.sessions[sid] += f" user turn {turn} of {sid}; assistant reply {turn}."
                sent_in = self.phase
                reply = await self.router.generate(self.sessions[sid], max_tokens=4, session_id=sid, task="chat")
                phase = sent_in if self.phase == sent_in else f"{sent_in}->{self.phase}"
                self.log.append(Sent(phase, sid, reply))
            turn += 1


async def redis_outage(
    router: RouterHandle,
    redis,
    replicas: ReplicaSet,
    *,
    tag: str = "outage-system",
    session_prefix: str = "",
    sessions: int = 4,
    per_phase: int = 12,
    quiet_restart: bool = False,
    timeout_s: float = 30.0,
) -> OutageRecord:
    """Kill Redis under session traffic, serve through the outage, restart it.

    Args:
        router: a started router following ``redis``.
        redis: the cluster's Redis process (``kill()``/``start()`` on the same port).
        tag: session ``i``'s system prompt is ``prompt_text(f"{tag}-{i}", 48)``.
        session_prefix: session ids are ``f"{session_prefix}s{i}"``.
        sessions: concurrent sessions (their turns are sent one after another).
        per_phase: requests sent in each of ``up``, ``down`` and ``after`` (at least).
        quiet_restart: False: traffic runs on through the restart and "rebuilt" means the
            index is in sync at every replica's current epoch. True: traffic stops before
            the restart and "rebuilt" means every replica's indexed blocks equal its cache
            (exact only without new events), then traffic resumes for ``after``.
        timeout_s: deadline of each wait.
    """
    await synced(router, replicas, timeout_s)
    texts = {f"{session_prefix}s{i}": prompt_text(f"{tag}-{i}", 48) for i in range(sessions)}
    log: list[Sent] = []
    traffic = _SessionTraffic(router, texts, log)
    traffic.start()
    try:
        await wait_for(lambda: traffic.count("up") >= per_phase, "traffic before the outage", timeout_s)
        before = await epochs(replicas)
        traffic.phase = "killing"
        redis.kill()
        t_kill = time.monotonic()
        await wait_for(lambda: not router.cluster.redis_connected, "router to notice the outage", timeout_s)
        noticed_s = time.monotonic() - t_kill
        traffic.phase = "down"
        await wait_for(lambda: traffic.count("down") >= per_phase, "traffic during the outage", timeout_s)
        if quiet_restart:
            await traffic.stop()
        else:
            traffic.phase = "restarting"
        redis.start()
        t0 = time.monotonic()
        await wait_for(lambda: router.cluster.redis_connected, "router to reconnect", timeout_s)
        reconnect_s = time.monotonic() - t0
        if quiet_restart:
            await wait_for(lambda: index_matches_caches(router, replicas), "indexed blocks == every replica's cache", timeout_s, 0.05)
        else:

            # NOTE: every replica starts a new epoch once Redis answers again, but not
            # necessarily before the router has resynced it at the old one: "rebuilt" is
            # the index in sync at each replica's *new* epoch, else the new epoch's first
            # batch makes the replica stale again while "after" traffic already runs.
            async def rebuilt() -> bool:
                current = await epochs(replicas)
                return all(epoch != before[rid] and router.in_sync(rid, epoch) for rid, epoch in current.items())

            await wait_for(rebuilt, "index rebuilt at every replica's new epoch", timeout_s, 0.05)
        rebuilt_s = time.monotonic() - t0
        traffic.phase = "after"
        if quiet_restart:
            traffic.start()
        await wait_for(lambda: traffic.count("after") >= per_phase, "traffic after Redis returned", timeout_s)
    finally:
        await traffic.stop()
    return OutageRecord(log, noticed_s, reconnect_s, rebuilt_s)


# ----------------------------------------------------------------------------- replica
@dataclass(slots=True)
class StreamEnd:
    """How one stream that was under way on the killed replica ended."""

    first_replica: str  # the route in its first message
    messages: int  # messages received, the first included
    code: grpc.StatusCode  # OK if it ended normally
    details: str = ""


@dataclass(slots=True)
class KillRecord:
    """What happened in ``replica_kill``.

    Attributes:
        victim: the replica killed (the one the prompt landed on).
        old / new: the victim's ``info()`` before the kill and after Ray restarted it.
        t_kill: when the kill was sent.
        restarted_at: when the restarted actor (new pid) was first seen.
        streams: the two streams under way, in start order.
        retried: the two requests waiting for a first token at the kill, in send order.
        background: (send time, reply) of the traffic sent from the kill until the rejoin.
        probe: the request the router had to send to the restarted victim.
        rejoined_s / served_s: kill -> back in the router at its new epoch / probe answered.
        late_calls_s: seconds after the kill of each Generate sent to the old address.
    """

    victim: str
    old: dict
    new: dict
    t_kill: float
    restarted_at: float
    streams: list[StreamEnd]
    retried: list[Reply]
    background: list[tuple[float, Reply]]
    probe: Reply
    rejoined_s: float
    served_s: float
    late_calls_s: list[float] = field(default_factory=list)


async def replica_kill(
    router: RouterHandle,
    replicas: ReplicaSet,
    *,
    tag: str = "kill",
    timeout_s: float = 30.0,
    rejoin_timeout_s: float = 120.0,
    rejoin_every_s: float = 0.1,
) -> KillRecord:
    """Kill the replica holding a prompt while it streams, queues and others serve.

    Prompts: ``prompt_text(tag, 800)`` plus suffixes; background ``f"{tag}-bg-{i}"``;
    probe ``f"{tag}-probe"``. The router should use ``locality_first`` so the streams and
    the pending requests land on the victim.
    """
    await synced(router, replicas, timeout_s)
    base = prompt_text(tag, 800)
    victim = (await first_reply(router, base)).replica
    old = await replicas.info(victim)
    await indexed_on(router, victim, base, "prompt indexed on the victim", timeout_s)

    # Two streams under way on the victim (slow tokens keep them open), then two requests
    # that reach it but get no token before it dies.
    await replicas.set_faults(victim, token_delay_s=0.2)
    calls = [router.call(base + f" long {i}", max_tokens=100) for i in range(2)]
    first_replicas = [(await call.read()).route.replica_id for call in calls]
    await replicas.set_faults(victim, first_token_delay_s=120.0, token_delay_s=0.2)
    n_before = len(router.calls_to(old["address"]))
    pending = [asyncio.create_task(router.generate(base + f" pending {i}")) for i in range(2)]
    await wait_for(lambda: len(router.calls_to(old["address"])) == n_before + 2, "pending requests at the victim", timeout_s)

    background: list[tuple[float, Reply]] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        i = 0
        while not stop.is_set():
            background.append((time.monotonic(), await router.generate(prompt_text(f"{tag}-bg-{i}", 64))))
            i += 1

    bg = asyncio.create_task(traffic())
    t_kill = time.monotonic()
    replicas.kill(victim)
    new: dict = {}
    restarted_at = 0.0
    try:
        streams = []
        for first, call in zip(first_replicas, calls):
            n = 1  # the first message, read above
            try:
                while await call.read() is not grpc.aio.EOF:
                    n += 1
                streams.append(StreamEnd(first, n, grpc.StatusCode.OK))
            except grpc.aio.AioRpcError as exc:
                streams.append(StreamEnd(first, n, exc.code(), exc.details() or ""))
        retried = list(await asyncio.gather(*pending))

        async def rejoined() -> bool:
            nonlocal restarted_at
            if not new:
                try:
                    now = await replicas.info(victim, timeout_s=5)
                except Exception:  # noqa: BLE001 - down or restarting
                    return False
                if now["pid"] == old["pid"]:
                    return False
                new.update(now)
                restarted_at = time.monotonic()
            rec = router.cluster.replicas.get(victim)
            return rec is not None and rec.address == new["address"] and router.in_sync(victim, new["epoch"])

        await wait_for(rejoined, "the victim restarted by Ray and back in the router", rejoin_timeout_s, rejoin_every_s)
        rejoined_s = time.monotonic() - t_kill
    finally:
        stop.set()
        await bg
    # NOTE: a probe the router must send to the victim (the others skipped): with
    # sequential traffic and equal costs, ties would always go to the lowest id.
    probe = await router.probe(victim, prompt_text(f"{tag}-probe", 64))
    served_s = time.monotonic() - t_kill
    await replicas.set_faults(victim)  # no-op on the restarted actor (fresh settings)
    late = [t - t_kill for t in router.calls_to(old["address"], t_kill)]
    return KillRecord(victim, old, new, t_kill, restarted_at, streams, retried, background, probe, rejoined_s, served_s, late)


# ------------------------------------------------------------------------------ router
@dataclass(slots=True)
class RestartRecord:
    """What happened in ``router_restart``.

    Attributes:
        cold / warm: the first router's two rounds over the prompts.
        after: the second router's rounds over the prompts, in send order.
        synced_at_send: per ``after`` request, whether the index followed every replica
            when it was sent.
        ready_s: second router's start -> it knew every replica (what /readyz reports).
    """

    cold: list[Reply]
    warm: list[Reply]
    after: list[Reply]
    synced_at_send: list[bool]
    ready_s: float


async def router_restart(
    make_router: Callable[[], Awaitable[RouterHandle]],
    replicas: ReplicaSet,
    *,
    tag: str = "restart",
    k: int = 6,
    n: int = 480,
    rounds: int = 1,
    wait_for_index: bool = True,
    timeout_s: float = 30.0,
) -> RestartRecord:
    """Run ``k`` prompts of ``n`` tokens twice through one router, stop it, start another.

    Args:
        make_router: builds and starts a router (called twice; the driver stops both).
        tag: prompt ``i`` is ``prompt_text(f"{tag}-{i}", n)``.
        rounds: rounds over the prompts through the second router.
        wait_for_index: True: send only once the new index equals every replica's cache
            (and each rebuilt send, as each warm one, once every replica's heartbeat shows
            it idle). False: send as soon as every replica is known (clients race the
            rebuild).
    """
    prompts = [prompt_text(f"{tag}-{i}", n) for i in range(k)]

    async def idle(router: RouterHandle) -> None:
        # NOTE: replicas beat once a second, so the router can still see the replica that
        # holds a prompt busy with an earlier request (a prefill's queued tokens outweigh
        # the prefix it holds) and place the prompt elsewhere; that race is the
        # heartbeat's, not the index's, which is what the warm and rebuilt sends check.
        await wait_for(lambda: all(ld.running + ld.waiting + ld.queued_prefill_tokens == 0 for ld in router.cluster.loads()),
                       "every replica's heartbeat idle", timeout_s)

    async def when_idle(router: RouterHandle, prompt: str) -> Reply:
        await idle(router)
        # NOTE: and once the index equals every replica's cache: the event batches can
        # lag the heartbeats. Measured on a fast host: at the first warm send the index,
        # in sync (no gap), lacked the last two cold prompts' 120 blocks and caught up
        # 63 ms later; a warm send in that window went elsewhere with nothing cached.
        # The warm sends check routing by an index that follows the caches, as the
        # rebuilt sends below do.
        await wait_for(lambda: index_matches_caches(router, replicas), "indexed blocks == caches", 10, 0.05)
        return await router.generate(prompt)

    first = await make_router()
    try:
        await synced(first, replicas, timeout_s)
        cold = [await first.generate(p) for p in prompts]
        warm = [await (when_idle(first, p) if wait_for_index else first.generate(p)) for p in prompts]
    finally:
        await first.stop()
    t0 = time.monotonic()
    second = await make_router()
    try:
        await wait_for(lambda: len(second.cluster.replicas) == len(replicas.ids), "replicas known", timeout_s, 0.005)
        ready_s = time.monotonic() - t0
        if wait_for_index:
            await synced(second, replicas, timeout_s)
            # Rebuilt from summaries + events alone (waited for: the last batches may still be in flight).
            await wait_for(lambda: index_matches_caches(second, replicas), "indexed blocks == caches", 10, 0.05)
        after, synced_at_send = [], []
        for _ in range(rounds):
            for p in prompts:
                if wait_for_index:
                    await idle(second)
                synced_at_send.append(all(second.in_sync(r) for r in replicas.ids))
                after.append(await second.generate(p))
    finally:
        await second.stop()
    return RestartRecord(cold, warm, after, synced_at_send, ready_s)


# -------------------------------------------------------------------------------- slow
@dataclass(slots=True)
class Timed:
    latency_s: float
    reply: Reply


@dataclass(slots=True)
class SlowRecord:
    """What happened in ``slow_replica``.

    Attributes:
        warm: the first request (it picked the slow replica).
        slow / slow_address: that replica and its address.
        baseline: requests for the prompt before the fault.
        t_fault: set right after the fault, before the first faulted request.
        faulted: requests for the prompt while the replica stalls, in order.
    """

    warm: Reply
    slow: str
    slow_address: str
    baseline: list[Timed]
    t_fault: float
    faulted: list[Timed]


async def slow_replica(
    router: RouterHandle,
    replicas: ReplicaSet,
    *,
    tag: str = "slow",
    n: int = 400,
    delay_s: float = 120.0,
    baseline: int = 0,
    faulted: int = 2,
    timeout_s: float = 30.0,
) -> SlowRecord:
    """The replica holding ``prompt_text(tag, n)`` gets a first-token delay of ``delay_s``;
    ``baseline`` requests for the prompt before it, ``faulted`` after. The router's forward
    deadline and policy (``locality_first``) are the caller's."""
    await synced(router, replicas, timeout_s)
    prompt = prompt_text(tag, n)
    warm = await first_reply(router, prompt)
    slow = warm.replica
    slow_address = router.cluster.replicas[slow].address
    await indexed_on(router, slow, prompt, "prompt indexed on its replica", timeout_s)

    async def timed() -> Timed:
        t = time.monotonic()
        r = await router.generate(prompt)
        return Timed(time.monotonic() - t, r)

    before = [await timed() for _ in range(baseline)]
    await replicas.set_faults(slow, first_token_delay_s=delay_s)
    try:
        t_fault = time.monotonic()
        during = [await timed() for _ in range(faulted)]
    finally:
        await replicas.set_faults(slow)
    return SlowRecord(warm, slow, slow_address, before, t_fault, during)


# ------------------------------------------------------------------------------ frozen
@dataclass(slots=True)
class FrozenRecord:
    """What happened in ``frozen_replica``.

    Attributes:
        frozen / frozen_address: the replica whose process was stopped, and its address.
        timeout_s: its derived first-token timeout when it froze.
        in_flight: the requests at the frozen replica when it froze (latency from send).
        timeouts: the router's first-token timeouts at it once those requests ended.
        t_freeze: when SIGSTOP was sent.
        during: requests for the prompt sent while it was frozen, in order.
        calls_while_frozen: seconds after the freeze of each client Generate sent to it.
        thawed_s: SIGCONT -> the router routes to it again (back in the index at its epoch).
    """

    frozen: str
    frozen_address: str
    timeout_s: float
    in_flight: list[Timed]
    timeouts: float
    t_freeze: float
    during: list[Timed]
    calls_while_frozen: list[float]
    thawed_s: float


async def frozen_replica(
    router: RouterHandle,
    replicas: ReplicaSet,
    *,
    tag: str = "frozen",
    n: int = 400,
    warm: int = 6,
    in_flight: int = 3,
    hold_s: float = 1.0,
    freeze_s: float = 4.0,
    during: int = 4,
    timeout_s: float = 30.0,
) -> FrozenRecord:
    """Freeze the process of the replica holding ``prompt_text(tag, n)`` with requests in flight.

    ``warm`` requests first (the router measures time to first token), then ``in_flight``
    concurrent requests that the replica holds ``hold_s`` before their first token (the
    fault hook, so they are surely in flight there), SIGSTOP once all reached it, then
    ``during`` sequential requests for the prompt; SIGCONT after ``freeze_s``. The router
    should use ``locality_first``.
    """
    await synced(router, replicas, timeout_s)
    prompt = prompt_text(tag, n)
    victim = (await first_reply(router, prompt)).replica
    address = router.cluster.replicas[victim].address
    pid = (await replicas.info(victim))["pid"]
    await indexed_on(router, victim, prompt, "prompt indexed on its replica", timeout_s)
    for _ in range(warm):
        await first_reply(router, prompt)
    ftt = router.app.core.first_token_timeout
    derived = ftt.timeout_s(victim) if ftt is not None else float("inf")

    async def timed(text: str) -> Timed:
        t = time.monotonic()
        r = await router.generate(text)
        return Timed(time.monotonic() - t, r)

    await replicas.set_faults(victim, first_token_delay_s=hold_s)
    n_before = len(router.calls_to(address))
    pending = [asyncio.create_task(timed(prompt + f" in flight {i}")) for i in range(in_flight)]
    try:
        await wait_for(lambda: len(router.calls_to(address)) >= n_before + in_flight, "requests in flight at the victim", timeout_s, 0.005)
        os.kill(pid, signal.SIGSTOP)
        t_freeze = time.monotonic()
        try:
            stuck = list(await asyncio.gather(*pending))
            timeouts = router.metrics_value("unicache_router_first_token_timeouts_total", replica=victim) or 0.0
            later = [await timed(prompt) for _ in range(during)]
            await asyncio.sleep(max(0.0, t_freeze + freeze_s - time.monotonic()))
        finally:
            os.kill(pid, signal.SIGCONT)
        t_thaw = time.monotonic()
        calls = [t - t_freeze for t in router.calls_to(address, t_freeze)]
        await replicas.set_faults(victim)

        async def back() -> bool:
            rec = router.cluster.replicas.get(victim)
            if rec is None or not router.cluster.healthy(victim):
                return False
            return router.in_sync(victim, (await replicas.info(victim))["epoch"])

        await wait_for(back, "the thawed replica back in routing", timeout_s, 0.02)
        thawed_s = time.monotonic() - t_thaw
    finally:
        for task in pending:
            task.cancel()
    return FrozenRecord(victim, address, derived, stuck, timeouts, t_freeze, later, calls, thawed_s)


# -------------------------------------------------------------------------- concurrent
@dataclass(slots=True)
class ConcurrentRecord:
    """What happened in ``concurrent_streams``: every reply (in send order), the wall
    time from the first send to the last reply, and the router's retries meanwhile."""

    replies: list[Timed]
    wall_s: float
    retries: float


async def concurrent_streams(router: RouterHandle, *, tag: str = "concurrent", n: int = 1000, max_tokens: int = 4) -> ConcurrentRecord:
    """``n`` streaming requests at once (distinct 64-byte prompts) through the router."""

    def retries() -> float:
        return router.app.metrics.registry.get_sample_value("unicache_router_retries_total") or 0.0

    async def timed(i: int) -> Timed:
        t = time.monotonic()
        r = await router.generate(prompt_text(f"{tag}-{i}", 64), max_tokens=max_tokens, timeout_s=300.0)
        return Timed(time.monotonic() - t, r)

    r0 = retries()
    t0 = time.monotonic()
    replies = list(await asyncio.gather(*(timed(i) for i in range(n))))
    return ConcurrentRecord(replies, time.monotonic() - t0, retries() - r0)
