"""Fault figures on a real loopback cluster: what each fault costs, measured.

A private redis-server, Ray in-process with three replica actors (tiny model, 8-token
blocks) and the router in-process, all from unicache/testing/cluster_harness.py, but with
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
    slow    a replica that stops answering (first-token delay 60 s), default router
            settings: latency of the request that hit it (the derived first-token
            timeout, then a retry) and of the ones after it (it is quarantined).
    frozen  the process of the replica holding a prompt is frozen (SIGSTOP) for 15 s with
            requests in flight there: what they cost against the derived first-token
            timeout, where the requests during the freeze went, SIGCONT -> back in routing.
    streams 1,000 concurrent streaming requests: failures, retries, latency.
    ghosts  ten replicas at dead addresses beside the three real ones (what a forged
            heartbeat or a replica that died before its heartbeat expired looks like to
            the request path): 30 sequential requests, failures, calls to the ghosts.

Every scenario also reports the router's retries (attempts moved to another replica
before a first token) and quarantines.

Run: ``.venv/bin/python -m bench.faults [--repeats 3]``; writes bench/results/faults.json
and bench/results/faults.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import socket
import statistics
import subprocess
import sys
from pathlib import Path

from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.testing import fault_scenarios as fs
from unicache.testing.cluster_harness import ReplicaSet, RouterHandle, locality_first, prompt_text, start_ray, stop_ray
from bench.paths import REPO, RESULTS

PREFIX = "faultbench"
BS = 8
PRODUCTION: dict = {}  # RedisSubscriber defaults
WAIT_S = 60.0  # deadline of each wait inside a scenario (production intervals are slower)


async def with_router(run, redis: EmbeddedRedis, **config):
    """Start a router with production subscriber settings, ``await run(router)``, stop it.
    Returns (the run's record, the router's counters: retries, quarantines)."""
    router = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION, **config)
    await router.start()
    try:
        rec = await run(router)
        return rec, counters(router)
    finally:
        await router.stop()


def counters(router: RouterHandle) -> dict:
    """The router's retries and quarantines so far (one router per scenario run)."""
    return {"retries": router.metrics_value("unicache_router_retries_total") or 0.0, "quarantines": len(router.quarantines)}


# ------------------------------------------------------------------------------- redis
async def redis_outage(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int) -> dict:
    # NOTE: quiet restart, so "index == cache" is exact rather than racing new events.
    rec, count = await with_router(
        lambda router: fs.redis_outage(
            router, redis, replicas, tag=f"bench-outage-{rep}", session_prefix=f"r{rep}", quiet_restart=True, timeout_s=WAIT_S
        ),
        redis,
        forward_deadline_s=60,
    )
    reasons = {
        p: dict(collections.Counter(s.reply.reason for s in rec.log if s.phase == p and s.reply.ok)) for p in ("up", "down", "after")
    }
    return {
        "requests": len(rec.log),
        "failed": sum(1 for s in rec.log if not s.reply.ok),
        "reasons": reasons,
        "outage_noticed_s": rec.noticed_s,
        "reconnect_s": rec.reconnect_s,
        "index_rebuilt_s": rec.rebuilt_s,
        **count,
    }


# ----------------------------------------------------------------------------- replica
async def replica_kill(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int) -> dict:
    rec, count = await with_router(
        lambda router: fs.replica_kill(
            router, replicas, tag=f"bench-kill-{rep}", timeout_s=WAIT_S, rejoin_timeout_s=180, rejoin_every_s=0.05
        ),
        redis,
        forward_deadline_s=120,
        policy_factory=locality_first,
    )
    return {
        "streams_on_victim": sum(s.first_replica == rec.victim for s in rec.streams),
        "stream_endings": [s.code.name for s in rec.streams],
        "pending_retried_ok": sum(1 for r in rec.retried if r.ok and r.replica != rec.victim),
        "background_requests": len(rec.background),
        "background_failed": sum(1 for _, r in rec.background if not r.ok),
        "calls_to_dead_address_after_kill": len(rec.late_calls_s),
        "last_call_to_dead_address_s": max(rec.late_calls_s, default=0.0),
        "actor_restarted_s": rec.restarted_at - rec.t_kill,
        "rejoined_index_s": rec.rejoined_s,
        "probe_served_by_victim": rec.probe.ok and rec.probe.replica == rec.victim,
        "first_served_s": rec.served_s,
        **count,
    }


# ------------------------------------------------------------------------------ router
async def router_restart(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, k: int = 8, n: int = 480) -> dict:
    async def make() -> RouterHandle:
        router = RouterHandle(redis.url, PREFIX, BS, subscriber_kwargs=PRODUCTION)
        await router.start()
        return router

    # NOTE: clients start as soon as the router knows every replica (what /readyz says),
    # not when its index is complete: the figure includes that race.
    rec = await fs.router_restart(
        make, replicas, tag=f"bench-restart-{rep}", k=k, n=n, rounds=2, wait_for_index=False, timeout_s=WAIT_S
    )
    warm = rec.warm
    pre_ratio = sum(r.cached_tokens for r in warm) / sum(r.prompt_tokens for r in warm)
    ok = [r.ok and r.cached_tokens >= warm[j % k].cached_tokens for j, r in enumerate(rec.after)]
    recovered_after = next((j for j in range(len(ok) + 1) if all(ok[j:])), len(ok))
    first_round = rec.after[:k]
    return {
        "prompts": k,
        "prompt_tokens": n,
        "pre_restart_hit_ratio": pre_ratio,
        "first_round_hit_ratio": sum(r.cached_tokens for r in first_round) / max(1, sum(r.prompt_tokens for r in first_round)),
        "requests_until_recovered": recovered_after,
        "requests_sent_before_index_synced": rec.synced_at_send.count(False),
        "ready_s": rec.ready_s,
        "failed": sum(1 for r in rec.after if not r.ok),
    }


# -------------------------------------------------------------------------------- slow
async def slow_replica(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int) -> dict:
    rec, count = await with_router(
        lambda router: fs.slow_replica(
            router, replicas, tag=f"bench-slow-{rep}", delay_s=60.0, baseline=5, faulted=6, timeout_s=WAIT_S
        ),
        redis,
        policy_factory=locality_first,
    )
    hit, later = rec.faulted[0], rec.faulted[1:]
    base_med = statistics.median(t.latency_s for t in rec.baseline)
    later_med = statistics.median(t.latency_s for t in later)
    return {
        "baseline_latency_s": base_med,
        "stall_hit_latency_s": hit.latency_s,
        "stall_hit_served_elsewhere": hit.reply.ok and hit.reply.replica != rec.slow,
        "later_latency_s": later_med,
        "later_over_baseline": later_med / base_med,
        "later_served_elsewhere": sum(1 for t in later if t.reply.ok and t.reply.replica != rec.slow),
        "later": len(later),
        **count,
    }


# ------------------------------------------------------------------------------ frozen
async def frozen_replica(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, freeze_s: float = 15.0) -> dict:
    rec, count = await with_router(
        lambda router: fs.frozen_replica(
            router, replicas, tag=f"bench-frozen-{rep}", in_flight=4, freeze_s=freeze_s, during=6, timeout_s=WAIT_S
        ),
        redis,
        policy_factory=locality_first,
    )
    costs = [t.latency_s for t in rec.in_flight]
    return {
        "freeze_s": freeze_s,
        "derived_timeout_s": rec.timeout_s,
        "in_flight": len(rec.in_flight),
        "in_flight_ok_elsewhere": sum(1 for t in rec.in_flight if t.reply.ok and t.reply.replica != rec.frozen),
        "in_flight_cost_s": costs,
        "in_flight_cost_max_over_timeout": max(costs) / rec.timeout_s,
        "during": len(rec.during),
        "during_ok_elsewhere": sum(1 for t in rec.during if t.reply.ok and t.reply.replica != rec.frozen),
        "during_latency_s": statistics.median(t.latency_s for t in rec.during),
        "calls_while_frozen": len(rec.calls_while_frozen),
        "thaw_to_routed_s": rec.thawed_s,
        **count,
    }


# ----------------------------------------------------------------------------- streams
async def concurrent_streams(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, n: int = 1000) -> dict:
    async def run(router: RouterHandle):
        await fs.synced(router, replicas, WAIT_S)
        return await fs.concurrent_streams(router, tag=f"bench-streams-{rep}", n=n)

    rec, count = await with_router(run, redis)
    lat = sorted(t.latency_s for t in rec.replies)
    return {
        "streams": n,
        "failed": sum(1 for t in rec.replies if not t.reply.ok),
        "failures": dict(collections.Counter(t.reply.code.name for t in rec.replies if not t.reply.ok)),
        "wall_s": rec.wall_s,
        "latency_p50_s": lat[len(lat) // 2],
        "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        **count,
    }


# ------------------------------------------------------------------------------ ghosts
def dead_addresses(n: int) -> list[str]:
    """Loopback addresses nothing listens on (ports bound, then closed)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


async def ghost_replicas(redis: EmbeddedRedis, replicas: ReplicaSet, rep: int, ghosts: int = 10, requests: int = 30) -> dict:
    addresses = dead_addresses(ghosts)

    async def run(router: RouterHandle):
        await fs.synced(router, replicas, WAIT_S)
        replies = [await router.generate(prompt_text(f"bench-ghost-{rep}-{i}", 64)) for i in range(requests)]
        return replies, [a for _, a in router.calls if a in addresses]

    (replies, ghost_calls), count = await with_router(
        run, redis, replicas=",".join(f"ghost-{i}={a}" for i, a in enumerate(addresses)), routing_policy="round_robin"
    )
    return {
        "ghosts": ghosts,
        "requests": requests,
        "failed": sum(1 for r in replies if not r.ok),
        "served_by_real": sum(1 for r in replies if r.ok and r.replica in replicas.ids),
        "client_calls_to_ghosts": len(ghost_calls),
        "distinct_ghosts_called": len(set(ghost_calls)),
        **count,
    }


# ------------------------------------------------------------------------------ report
SCENARIOS = {
    "redis": redis_outage,
    "replica": replica_kill,
    "router": router_restart,
    "slow": slow_replica,
    "frozen": frozen_replica,
    "streams": concurrent_streams,
    "ghosts": ghost_replicas,
}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def counts_row(xs: list[dict]) -> str:
    """Retries and quarantines summed over the repeats."""
    return f"| | router retries, quarantines (all repeats) | {sum(x['retries'] for x in xs):.0f}, {sum(x['quarantines'] for x in xs):.0f} |"


def markdown(res: dict) -> str:
    r, k, t, s, f, c, g = (
        res["scenarios"].get(x, []) for x in ("redis", "replica", "router", "slow", "frozen", "streams", "ghosts")
    )
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
            counts_row(r),
        ]
    if k:
        ends = collections.Counter(e for x in k for e in x["stream_endings"])
        lines += [
            f"| Replica actor killed | streams under way | {', '.join(f'{e} {v}' for e, v in sorted(ends.items()))} |",
            f"| | requests without a token, retried elsewhere and OK | {sum(x['pending_retried_ok'] for x in k)} of {2 * len(k)} |",
            f"| | failed background requests | {sum(x['background_failed'] for x in k)} of {sum(x['background_requests'] for x in k)} |",
            f"| | client calls to the dead address after the kill | {', '.join(str(x['calls_to_dead_address_after_kill']) for x in k)} |",
            f"| | last call to the dead address after the kill, s | {spread([x['last_call_to_dead_address_s'] for x in k])} |",
            f"| | kill -> Ray restarted the actor, s | {spread([x['actor_restarted_s'] for x in k])} |",
            f"| | kill -> back in the router's index (new epoch), s | {spread([x['rejoined_index_s'] for x in k])} |",
            f"| | kill -> a request routed to it served (probe), s | {spread([x['first_served_s'] for x in k])} |",
            counts_row(k),
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
            f"| Replica stalls before its first token (60 s delay) | request that hit it, s (served elsewhere: "
            f"{sum(x['stall_hit_served_elsewhere'] for x in s)} of {len(s)}) | {spread([x['stall_hit_latency_s'] for x in s])} |",
            f"| | next requests served elsewhere | {sum(x['later_served_elsewhere'] for x in s)} of {sum(x['later'] for x in s)} |",
            f"| | next requests / before the fault (latency ratio) | {spread([x['later_over_baseline'] for x in s])} |",
            counts_row(s),
        ]
    if f:
        lines += [
            f"| Replica frozen (SIGSTOP {f[0]['freeze_s']:.0f} s) with requests in flight | derived first-token timeout, s | "
            f"{spread([x['derived_timeout_s'] for x in f])} |",
            f"| | in-flight requests served elsewhere | {sum(x['in_flight_ok_elsewhere'] for x in f)} of {sum(x['in_flight'] for x in f)} |",
            f"| | **in-flight cost (send -> reply), s** | {spread([v for x in f for v in x['in_flight_cost_s']])} |",
            f"| | worst in-flight cost / derived timeout | {spread([x['in_flight_cost_max_over_timeout'] for x in f])} |",
            f"| | requests during the freeze served elsewhere | {sum(x['during_ok_elsewhere'] for x in f)} of {sum(x['during'] for x in f)} |",
            f"| | latency of requests during the freeze, s | {spread([x['during_latency_s'] for x in f])} |",
            f"| | client calls to the frozen replica after the freeze | {', '.join(str(x['calls_while_frozen']) for x in f)} |",
            f"| | SIGCONT -> routed to again, s | {spread([x['thaw_to_routed_s'] for x in f])} |",
            counts_row(f),
        ]
    if c:
        failures = collections.Counter()
        for x in c:
            failures.update(x["failures"])
        lines += [
            f"| {c[0]['streams']:,} concurrent streams | failed | {sum(x['failed'] for x in c)} of {sum(x['streams'] for x in c)}"
            + (f" ({', '.join(f'{e} {v}' for e, v in sorted(failures.items()))})" if failures else "") + " |",
            f"| | wall time, s | {spread([x['wall_s'] for x in c])} |",
            f"| | latency p50 / p99, s | {spread([x['latency_p50_s'] for x in c])} / {spread([x['latency_p99_s'] for x in c])} |",
            counts_row(c),
        ]
    if g:
        lines += [
            f"| {g[0]['ghosts']} ghost replicas (dead addresses) beside 3 real | failed client requests | "
            f"{sum(x['failed'] for x in g)} of {sum(x['requests'] for x in g)} (served by real replicas: {sum(x['served_by_real'] for x in g)}) |",
            "| | client calls to ghosts (distinct ghosts) | " + ", ".join(f"{x['client_calls_to_ghosts']} ({x['distinct_ghosts_called']})" for x in g) + " |",
            counts_row(g),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--out", default=str(RESULTS / "faults"))
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
    out["command"] = "python -m bench.faults " + " ".join(sys.argv[1:])
    out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
