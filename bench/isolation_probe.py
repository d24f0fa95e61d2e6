"""Cross-tenant cache timing probe: can one tenant tell, by time to first token, whether
another tenant has a prompt cached?

One real replica (AsyncEngine with the default seeded model, ReplicaServer on port 0)
behind the real router (static replica, auth on, two tenants). Per trial:
    1. the victim sends a fresh prompt P (now cached on the replica under the victim's salt);
    2. in a random order: the attacker sends P ("cross_cached") and a never-seen prompt Q
       ("cross_fresh"); the victim sends P again ("own_cached", positive control) and a
       never-seen prompt R ("own_fresh").
TTFT is measured by the client from sending the gRPC request to the router until its
first streamed message (``max_tokens`` 1). Each pair of distributions is compared with a
two-sided Mann-Whitney U test (normal approximation with tie correction); ``auc`` is
U / (n1 n2), the probability that a draw from the first is slower than one from the
second (0.5: indistinguishable). The replica-reported ``cached_tokens`` are recorded too.

Expected: own_cached vs own_fresh differs (p tiny, auc near 0: the control shows the probe
can see a cache hit); cross_cached vs cross_fresh does not (p large, auc near 0.5), since
the attacker's salt makes every block hash differ from the victim's.

Run: .venv/bin/python -m bench.isolation_probe [--trials 40] [--prompt-tokens 1024]
     [--device cpu] [--out bench/results/isolation_probe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import string
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np

from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.serving.server import ReplicaServer
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

KEYS = {"victim": "sk-victim", "attacker": "sk-attacker"}
CATEGORIES = ("cross_cached", "cross_fresh", "own_cached", "own_fresh")


def mann_whitney_u(x: list[float], y: list[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p-value), normal approximation with tie
    correction and continuity correction (adequate for n >= 20 per group)."""
    n1, n2 = len(x), len(y)
    values = np.concatenate([np.asarray(x, float), np.asarray(y, float)])
    order = values.argsort(kind="mergesort")
    ranks = np.empty(len(values))
    sorted_vals = values[order]
    i = 0
    tie_term = 0.0
    while i < len(values):  # average ranks over ties
        j = i
        while j + 1 < len(values) and sorted_vals[j + 1] == sorted_vals[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    mu = n1 * n2 / 2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))))
    if sigma == 0:
        return float(u1), 1.0
    z = (abs(u1 - mu) - 0.5) / sigma
    p = math.erfc(max(z, 0.0) / math.sqrt(2))
    return float(u1), float(min(1.0, p))


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return {
        "n": len(s),
        "p10_ms": round(1e3 * q(0.1), 3),
        "p50_ms": round(1e3 * q(0.5), 3),
        "p90_ms": round(1e3 * q(0.9), 3),
        "mean_ms": round(1e3 * statistics.fmean(s), 3),
    }


def compare(a: list[float], b: list[float]) -> dict:
    u, p = mann_whitney_u(a, b)
    return {
        "u": u,
        "p_value": p,
        "auc": round(u / (len(a) * len(b)), 4),
        "median_ratio": round(statistics.median(a) / statistics.median(b), 4),
    }


async def run(args) -> dict:
    engine = AsyncEngine(
        EngineConfig(num_blocks=args.num_blocks, block_size=16, eviction_policy="lru", device=args.device, seed=0)
    )
    await engine.start()
    server = ReplicaServer(engine, "r0")
    port = await server.start()
    env = {
        "UNICACHE_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items()),
        "UNICACHE_SALT_SECRET": "probe-secret",
    }
    overrides = {"grpc_port": 0, "http_port": 0, "use_redis": False, "replicas": f"r0=127.0.0.1:{port}", "block_size": 16}
    app = RouterApp(build_config(env=env, overrides=overrides))
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    stub = router_pb2_grpc.RouterStub(channel)
    rng = random.Random(args.seed)
    sampling = common_pb2.SamplingParams(max_tokens=1)

    def fresh() -> str:
        return "".join(rng.choice(string.ascii_letters + string.digits + " ") for _ in range(args.prompt_tokens))

    async def ttft(tenant: str, text: str) -> tuple[float, int]:
        req = router_pb2.RouterGenerateRequest(text=text, sampling=sampling)
        call = stub.Generate(req, metadata=[("x-api-key", KEYS[tenant])], timeout=120)
        t0 = time.perf_counter()
        first = await call.read()
        dt = time.perf_counter() - t0
        last = first
        while (msg := await call.read()) is not grpc.aio.EOF:
            last = msg
        return dt, last.usage.cached_tokens

    times: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    cached: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    try:
        for _ in range(args.warmup):
            await ttft("victim", fresh())
            await ttft("attacker", fresh())
        for _ in range(args.trials):
            p = fresh()
            await ttft("victim", p)  # the victim's prompt is now cached
            steps = [("cross_cached", "attacker", p), ("cross_fresh", "attacker", fresh()),
                     ("own_cached", "victim", p), ("own_fresh", "victim", fresh())]
            rng.shuffle(steps)
            for cat, tenant, text in steps:
                dt, hit = await ttft(tenant, text)
                times[cat].append(dt)
                cached[cat].append(hit)
    finally:
        await channel.close()
        await app.stop()
        await server.stop()
        await engine.stop()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "commit": commit,
        "device": args.device,
        "trials": args.trials,
        "prompt_tokens": args.prompt_tokens,
        "seed": args.seed,
        "ttft": {c: summary(times[c]) for c in CATEGORIES},
        "cached_tokens_mean": {c: statistics.fmean(cached[c]) for c in CATEGORIES},
        "cross_tenant_cached_vs_fresh": compare(times["cross_cached"], times["cross_fresh"]),
        "own_tenant_cached_vs_fresh": compare(times["own_cached"], times["own_fresh"]),
        "raw_ms": {c: [round(1e3 * t, 3) for t in times[c]] for c in CATEGORIES},
    }


def markdown(r: dict) -> str:
    lines = [
        "# Cross-tenant cache timing probe",
        "",
        f"`.venv/bin/python -m bench.isolation_probe --trials {r['trials']} --prompt-tokens {r['prompt_tokens']} "
        f"--device {r['device']}` (commit {r['commit']}; one real replica behind the real router, default seeded model, "
        "TTFT measured by the client through router gRPC, max_tokens 1).",
        "",
        "| requests | tenant | n | TTFT p10 ms | p50 ms | p90 ms | mean cached tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    who = {"cross_cached": ("victim-cached prompt", "attacker"), "cross_fresh": ("never-seen prompt", "attacker"),
           "own_cached": ("own cached prompt", "victim"), "own_fresh": ("never-seen prompt", "victim")}
    for c in CATEGORIES:
        s = r["ttft"][c]
        lines.append(f"| {who[c][0]} | {who[c][1]} | {s['n']} | {s['p10_ms']} | {s['p50_ms']} | {s['p90_ms']} | "
                     f"{r['cached_tokens_mean'][c]:.0f} |")
    x, o = r["cross_tenant_cached_vs_fresh"], r["own_tenant_cached_vs_fresh"]
    lines += [
        "",
        "| comparison (Mann-Whitney U, two-sided) | p-value | AUC | median ratio |",
        "|---|---|---|---|",
        f"| attacker: victim-cached vs never-seen | {x['p_value']:.3g} | {x['auc']} | {x['median_ratio']} |",
        f"| control, victim: own cached vs never-seen | {o['p_value']:.3g} | {o['auc']} | {o['median_ratio']} |",
        "",
        "AUC = P(first slower than second); 0.5 means indistinguishable. The control shows the probe "
        "sees a cache hit when there is one; across tenants the salted hashes never match, so the "
        "victim's cache gives the attacker nothing to time.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/isolation_probe", help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
