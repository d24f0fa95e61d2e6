"""Fault figures on a real loopback cluster: what each fault costs, measured.

A private redis-server, Ray in-process with three replica actors (tiny model, 8-token
blocks) and the router in-process, all from tests/support/cluster_harness.py, but with
the router's *production* Redis subscriber settings (1 s heartbeat scans, 0.1-5 s
reconnect backoff) and the replicas' production publisher settings (1 s heartbeats, 3 s
TTL, 50 ms event flushes). Each scenario runs ``--repeats`` times; the tables give the
median and the range. Scenarios and figures (docs/reliability.md):

    redis   kill redis-server under steady session traffic, serve through the outage,
            restart it on the same port: failed requests, route reasons while down,
            seconds from restart until every replica's indexed blocks equal its cache.
    replica kill a replica actor (Ray restarts it) with two streams under way and two
            requests waiting for their first token: how those end, failed background
            requests, seconds until the router stops dialling the dead address, until
            the restarted replica is back in the index, until it serves again.
    router  stop the router and start a new one on a repeating workload: requests after
            restart until the hit ratio is back at its pre-restart level.
    slow    a replica that stops answering (first-token delay 60 s) with a 2 s forward
            deadline: latency of the request that hit it and of the ones after it.

Run: ``.venv/bin/python bench/faults.py [--repeats 3]``; writes bench/results/faults.json
and bench/results/faults.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: the harness lives in tests/support (not an installed package)

import grpc  # noqa: E402

from tests.support.cluster_harness import (  # noqa: E402
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
from unicache.redis_server import EmbeddedRedis  # noqa: E402

PREFIX = "faultbench"
BS = 8
PRODUCTION: dict = {}  # RedisSubscriber defaults


async def synced(router: RouterHandle, replicas: ReplicaSet) -> None:
    await wait_for(lambda: all(router.in_sync(r) for r in replicas.ids), "router in sync", 60)


# ------------------------------------------------------------------------------- redis
async def redis_outage(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int) -> dict:
    router = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION, forward_deadline_s=60)
    await router.start()
    try:
        await synced(router, replicas)
        sessions = {f"r{rep}s{i}": prompt_text(f"bench-outage-{rep}-{i}", 48) for i in range(4)}
        phase = "up"
        log: list[tuple[str, object]] = []
        stop = asyncio.Event()

        async def traffic() -> None:
            turn = 0
            while not stop.is_set():
                for sid in sessions:
                    sessions[sid] += f" user turn {turn} of {sid}; assistant reply {turn}."
                    sent_in = phase  # the phase when the request was sent, not when it ended
                    log.append((sent_in, await router.generate(sessions[sid], session_id=sid, task="chat")))
                turn += 1

        def count(p: str) -> int:
            return sum(1 for ph, _ in log if ph == p)

        task = asyncio.create_task(traffic())
        await wait_for(lambda: count("up") >= 12, "traffic before the outage", 60)
        phase = "killing"
        redis.kill()
        t_kill = time.monotonic()
        await wait_for(lambda: not router.cluster.redis_connected, "outage noticed", 30)
        noticed_s = time.monotonic() - t_kill
        phase = "down"
        await wait_for(lambda: count("down") >= 12, "traffic while Redis is down", 60)
        stop.set()
        await task
        # NOTE: quiet restart, so "index == cache" is exact rather than racing new events.
        redis.start()
        t0 = time.monotonic()
        await wait_for(lambda: router.cluster.redis_connected, "reconnect", 60)
        reconnect_s = time.monotonic() - t0
        await wait_for(lambda: index_matches_caches(router, replicas), "index rebuilt", 60, 0.05)
        rebuild_s = time.monotonic() - t0
        stop.clear()
        phase = "after"
        task = asyncio.create_task(traffic())
        await wait_for(lambda: count("after") >= 12, "traffic after Redis returned", 60)
        stop.set()
        await task
    finally:
        await router.stop()
    reasons = {p: dict(collections.Counter(r.reason for ph, r in log if ph == p and r.ok)) for p in ("up", "down", "after")}
    return {
        "requests": len(log),
        "failed": sum(1 for _, r in log if not r.ok),
        "reasons": reasons,
        "outage_noticed_s": noticed_s,
        "reconnect_s": reconnect_s,
        "index_rebuilt_s": rebuild_s,
    }


# ----------------------------------------------------------------------------- replica
async def replica_kill(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int) -> dict:
    router = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION, forward_deadline_s=120, policy_factory=locality_first)
    await router.start()
    try:
        await synced(router, replicas)
        base = prompt_text(f"bench-kill-{rep}", 800)
        warm = await router.generate(base)
        victim = warm.replica
        old = await replicas.info(victim)
        await wait_for(lambda: router.app.index.match(victim, prompt_hashes(router, base)) > 0, "prompt indexed", 30)
        await replicas.set_faults(victim, token_delay_s=0.2)
        streams = [router.call(base + f" long {i}", max_tokens=100) for i in range(2)]
        on_victim = []
        for call in streams:
            on_victim.append((await call.read()).route.replica_id == victim)
        await replicas.set_faults(victim, first_token_delay_s=120.0, token_delay_s=0.2)
        n0 = len(router.calls_to(old["address"]))
        pending = [asyncio.create_task(router.generate(base + f" pending {i}")) for i in range(2)]
        await wait_for(lambda: len(router.calls_to(old["address"])) == n0 + 2, "pending at the victim", 30)

        background: list = []
        stop = asyncio.Event()

        async def traffic() -> None:
            i = 0
            while not stop.is_set():
                background.append((time.monotonic(), await router.generate(prompt_text(f"bench-kill-bg-{rep}-{i}", 64))))
                i += 1

        bg = asyncio.create_task(traffic())
        t_kill = time.monotonic()
        replicas.kill(victim)
        stream_codes = []
        for call in streams:
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
                stream_codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                stream_codes.append(exc.code().name)
        retried = await asyncio.gather(*pending)
        new: dict = {}

        async def rejoined() -> bool:
            if not new:
                try:
                    now = await replicas.info(victim, timeout_s=5)
                except Exception:  # noqa: BLE001 - restarting
                    return False
                if now["pid"] == old["pid"]:
                    return False
                new.update(now, seen=time.monotonic())
            rec = router.cluster.replicas.get(victim)
            return rec is not None and rec.address == new["address"] and router.in_sync(victim, new["epoch"])

        await wait_for(rejoined, "victim back in the router", 180, 0.05)
        rejoin_s = time.monotonic() - t_kill
        stop.set()
        await bg
        # NOTE: a probe the router must send to the victim (the others skipped): with
        # sequential traffic and equal costs, ties would always go to the lowest id.
        probe = await router.probe(victim, prompt_text(f"bench-kill-probe-{rep}", 64))
        served_s = time.monotonic() - t_kill
        await replicas.set_faults(victim)  # no-op on the restarted actor (fresh settings)
    finally:
        await router.stop()
    late = [t - t_kill for t in router.calls_to(old["address"], t_kill)]
    return {
        "streams_on_victim": sum(on_victim),
        "stream_endings": stream_codes,
        "pending_retried_ok": sum(1 for r in retried if r.ok and r.replica != victim),
        "background_requests": len(background),
        "background_failed": sum(1 for _, r in background if not r.ok),
        "calls_to_dead_address_after_kill": len(late),
        "last_call_to_dead_address_s": max(late, default=0.0),
        "actor_restarted_s": new["seen"] - t_kill,
        "rejoined_index_s": rejoin_s,
        "probe_served_by_victim": probe.ok and probe.replica == victim,
        "first_served_s": served_s,
    }


# ------------------------------------------------------------------------------ router
async def router_restart(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, k: int = 8, n: int = 480) -> dict:
    prompts = [prompt_text(f"bench-restart-{rep}-{i}", n) for i in range(k)]
    first = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION)
    await first.start()
    try:
        await synced(first, replicas)
        for p in prompts:
            await first.generate(p)
        warm = [await first.generate(p) for p in prompts]
    finally:
        await first.stop()
    pre_ratio = sum(r.cached_tokens for r in warm) / sum(r.prompt_tokens for r in warm)
    second = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION)
    t0 = time.monotonic()
    await second.start()
    try:
        # NOTE: clients start as soon as the router knows every replica (what /readyz says),
        # not when its index is complete: the figure includes that race.
        await wait_for(lambda: len(second.cluster.replicas) == len(replicas.ids), "replicas known", 60, 0.005)
        ready_s = time.monotonic() - t0
        after, synced_at_send = [], []
        for _ in range(2):
            for i, p in enumerate(prompts):
                synced_at_send.append(all(second.in_sync(r) for r in replicas.ids))
                after.append((i, await second.generate(p)))
    finally:
        await second.stop()
    ok = [r.ok and r.cached_tokens >= warm[i].cached_tokens for i, r in after]
    recovered_after = next((j for j in range(len(ok) + 1) if all(ok[j:])), len(ok))
    first_round = [r for _, r in after[:k]]
    return {
        "prompts": k,
        "prompt_tokens": n,
        "pre_restart_hit_ratio": pre_ratio,
        "first_round_hit_ratio": sum(r.cached_tokens for r in first_round) / max(1, sum(r.prompt_tokens for r in first_round)),
        "requests_until_recovered": recovered_after,
        "requests_sent_before_index_synced": synced_at_send.count(False),
        "ready_s": ready_s,
        "failed": sum(1 for _, r in after if not r.ok),
    }


# -------------------------------------------------------------------------------- slow
async def slow_replica(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, deadline_s: float = 2.0) -> dict:
    router = RouterHandle(
        redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION, forward_deadline_s=deadline_s, policy_factory=locality_first
    )
    await router.start()
    try:
        await synced(router, replicas)
        prompt = prompt_text(f"bench-slow-{rep}", 400)
        warm = await router.generate(prompt)
        slow = warm.replica
        await wait_for(lambda: router.app.index.match(slow, prompt_hashes(router, prompt)) > 0, "prompt indexed", 30)

        async def timed() -> tuple[float, object]:
            t = time.monotonic()
            r = await router.generate(prompt)
            return time.monotonic() - t, r

        baseline = [await timed() for _ in range(5)]
        await replicas.set_faults(slow, first_token_delay_s=60.0)
        try:
            hit = await timed()
            later = [await timed() for _ in range(5)]
        finally:
            await replicas.set_faults(slow)
    finally:
        await router.stop()
    base_med = statistics.median(t for t, _ in baseline)
    later_med = statistics.median(t for t, _ in later)
    return {
        "forward_deadline_s": deadline_s,
        "baseline_latency_s": base_med,
        "deadline_hit_latency_s": hit[0],
        "deadline_hit_served_elsewhere": hit[1].ok and hit[1].replica != slow,
        "later_latency_s": later_med,
        "later_over_baseline": later_med / base_med,
        "later_served_elsewhere": sum(1 for _, r in later if r.ok and r.replica != slow),
    }


# ------------------------------------------------------------------------------ report
SCENARIOS = {"redis": redis_outage, "replica": replica_kill, "router": router_restart, "slow": slow_replica}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown(res: dict) -> str:
    r, k, t, s = (res["scenarios"].get(x, []) for x in ("redis", "replica", "router", "slow"))
    lines = [
        "# Fault figures",
        "",
        f"`{res['command']}` at commit `{res['commit']}`; {res['repeats']} repeats, median (range). "
        "Shared 2-core host: seconds vary with the other jobs on it.",
        "",
        "| fault | figure | value |",
        "|---|---|---|",
    ]
    if r:
        down = collections.Counter()
        for x in r:
            down.update(x["reasons"]["down"])
        lines += [
            f"| Redis killed, restarted | failed client requests | {sum(x['failed'] for x in r)} of {sum(x['requests'] for x in r)} |",
            f"| | route reasons while down | {', '.join(f'{k2} {v}' for k2, v in sorted(down.items()))} |",
            f"| | outage noticed by the router, s | {spread([x['outage_noticed_s'] for x in r])} |",
            f"| | restart -> router reconnected, s | {spread([x['reconnect_s'] for x in r])} |",
            f"| | restart -> every replica's index == its cache, s | {spread([x['index_rebuilt_s'] for x in r])} |",
        ]
    if k:
        ends = collections.Counter(c for x in k for c in x["stream_endings"])
        lines += [
            f"| Replica actor killed | streams under way | {', '.join(f'{c} {v}' for c, v in sorted(ends.items()))} |",
            f"| | requests without a token, retried elsewhere and OK | {sum(x['pending_retried_ok'] for x in k)} of {2 * len(k)} |",
            f"| | failed background requests | {sum(x['background_failed'] for x in k)} of {sum(x['background_requests'] for x in k)} |",
            f"| | last call to the dead address after the kill, s | {spread([x['last_call_to_dead_address_s'] for x in k])} |",
            f"| | kill -> Ray restarted the actor, s | {spread([x['actor_restarted_s'] for x in k])} |",
            f"| | kill -> back in the router's index (new epoch), s | {spread([x['rejoined_index_s'] for x in k])} |",
            f"| | kill -> a request routed to it served (probe), s | {spread([x['first_served_s'] for x in k])} |",
        ]
    if t:
        lines += [
            f"| Router restarted | hit ratio before restart | {spread([x['pre_restart_hit_ratio'] for x in t])} |",
            f"| | hit ratio of the first round after restart | {spread([x['first_round_hit_ratio'] for x in t])} |",
            f"| | requests until the hit ratio recovered | {', '.join(str(x['requests_until_recovered']) for x in t)} |",
            f"| | requests sent before the index was in sync | {', '.join(str(x['requests_sent_before_index_synced']) for x in t)} |",
            f"| | start -> every replica known, s | {spread([x['ready_s'] for x in t])} |",
        ]
    if s:
        lines += [
            f"| Slow replica (deadline {s[0]['forward_deadline_s']:.0f} s) | request that hit it, s (served elsewhere: "
            f"{sum(x['deadline_hit_served_elsewhere'] for x in s)} of {len(s)}) | {spread([x['deadline_hit_latency_s'] for x in s])} |",
            f"| | next requests / before the fault (latency ratio) | {spread([x['later_over_baseline'] for x in s])} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default="redis,replica,router,slow")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults"))
    args = ap.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    redis = EmbeddedRedis()
    redis.start()
    tmp = start_ray(num_cpus=4)
    replicas = ReplicaSet(redis.url, PREFIX, num=3)
    out: dict = {"scenarios": {n: [] for n in names}}
    try:
        replicas.start()

        async def run() -> None:
            for rep in range(args.repeats):
                for name in names:
                    fig = await SCENARIOS[name](redis, replicas, rep)
                    out["scenarios"][name].append(fig)
                    print(name, rep, json.dumps(fig), flush=True)

        asyncio.run(run())
    finally:
        try:
            replicas.stop()
        finally:
            stop_ray(tmp)
            redis.close()
    out["repeats"] = args.repeats
    out["command"] = "python bench/faults.py " + " ".join(sys.argv[1:])
    out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
