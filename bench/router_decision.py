"""The router's whole decision path for one request, as the live router runs it:
tokenize -> hash (salted) -> classify -> policy.choose, for an 8,000-token prompt with
8 replicas x 100,000 indexed blocks (bench/routing_latency.py times ``choose`` alone).

Replica i holds the first (i + 1) / 8 of the prompt's blocks plus random filler, so the
index lookups scan long matches. Each iteration uses a fresh prompt suffix so the
classifier sees new requests. Reports p50/p99 per stage and in total (ms).

Run: .venv/bin/python -m bench.router_decision [--iters 300] [--policy cache_aware] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from unicache.contract.block_hash import BlockHash, hash_token_blocks
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.request_path.core import Labelled
from unicache.sim.metrics import percentile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks-per-replica", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = build_config(
        env={"UNICACHE_API_KEYS": "k:bench", "UNICACHE_SALT_SECRET": "s"},
        overrides={"use_redis": False, "routing_policy": args.policy, "replicas": ",".join(f"r{i}=127.0.0.1:{9000 + i}" for i in range(args.replicas))},
    )
    app = RouterApp(cfg)
    core = app.core
    app.cluster.redis_connected = True  # let the policy see the index
    rng = random.Random(0)
    base = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.prompt_tokens - 16))
    base_hashes = hash_token_blocks(core.encode(base), cfg.block_size, cache_salt=app.auth.cache_salt("bench"))
    for i in range(args.replicas):
        keep = base_hashes[: (i + 1) * len(base_hashes) // args.replicas]
        filler = [BlockHash(os.urandom(16)) for _ in range(args.blocks_per_replica - len(keep))]
        app.index.apply_summary(f"r{i}", 1, 0, filler + keep)
    stages: dict[str, list[float]] = {"tokenize": [], "hash_classify": [], "choose": [], "total": []}
    for it in range(args.iters):
        text = base + f"{it:016d}"
        t0 = time.perf_counter()
        ids = core.encode(text)
        t1 = time.perf_counter()
        prep = core.prepare("bench", ids, Labelled())
        t2 = time.perf_counter()
        decision = core.choose(prep.routing, set())
        t3 = time.perf_counter()
        assert decision.replica_id
        for name, dt in (("tokenize", t1 - t0), ("hash_classify", t2 - t1), ("choose", t3 - t2), ("total", t3 - t0)):
            stages[name].append(dt * 1e3)
    out = {name: {"p50_ms": round(percentile(xs, 50), 4), "p99_ms": round(percentile(xs, 99), 4)} for name, xs in stages.items()}
    print(f"policy {args.policy}, {args.prompt_tokens}-token prompt, {args.replicas} replicas x {args.blocks_per_replica} blocks")
    for name, r in out.items():
        print(f"  {name:<14} p50 {r['p50_ms']:8.3f} ms   p99 {r['p99_ms']:8.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "stages": out}, f, indent=2)


if __name__ == "__main__":
    main()
