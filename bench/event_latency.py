"""Event latency: from a block being stored in the engine's KV cache to its event being
readable in Redis, through the real engine, CachePublisher and a private redis-server.

The engine stamps each ``BlockStored`` with ``time.monotonic()`` when the block joins the
cache; a reader in the same process (XREAD BLOCK on the replica's stream) stamps each
hash when its batch arrives. Latency = arrival - stored. As a floor, the same run measures
one XADD -> XREAD round trip without batching; the batching period (50 ms) is the other
reference. Target: p99 <= 100 ms.

Run: .venv/bin/python -m bench.event_latency [--requests 200] [--concurrency 8]
         [--json bench/results/event_latency.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import redis.asyncio as aioredis

from unicache.contract.kv_events import BlockStored
from unicache.contract.redis_keys import EVENT_FLUSH_INTERVAL_S, RedisKeys
from unicache.contract.state_auth import StateSigner, new_cluster_key, parse_cluster_key
from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.publishing.publisher import CachePublisher
from unicache.sim.metrics import percentile
from unicache.v1 import cache_pb2

KEYS = RedisKeys("bench")
SIGNER = StateSigner(parse_cluster_key(new_cluster_key()))


class StampingSource:
    """Delegates to the engine and remembers each stored hash's engine timestamp."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.device = engine.device
        self.block_size = engine.block_size
        self.stored_at: dict[bytes, float] = {}

    def take_events(self):
        events = self.engine.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored_at.setdefault(ev.block_hash, ev.timestamp)
        return events

    def cached_hashes(self):
        return self.engine.cached_hashes()

    def host_hashes(self):
        return self.engine.host_hashes()

    def cached_blocks(self):
        return self.engine.cached_blocks()

    def load(self):
        return self.engine.load()

    def cache_state(self):
        return self.engine.cache_state()


async def reader(url: str, arrived: dict[bytes, float], stop: asyncio.Event) -> None:
    r = aioredis.Redis.from_url(url, socket_timeout=5)
    last = "0-0"
    while not stop.is_set():
        resp = await r.xread({KEYS.events("r0"): last}, block=200, count=1000)
        now = time.monotonic()
        for _, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id
                # the reader verifies the MAC as a router does (part of the measured latency)
                for h in cache_pb2.KVEventBatch.FromString(SIGNER.open("events", fields[b"b"])).stored:
                    arrived.setdefault(h, now)
    await r.aclose()


async def redis_floor(url: str, n: int = 200) -> list[float]:
    """One XADD -> XREAD round trip per sample (no batching), same clients and loop."""
    w = aioredis.Redis.from_url(url, socket_timeout=5)
    rd = aioredis.Redis.from_url(url, socket_timeout=5)
    key = f"{KEYS.prefix}:floor"
    out = []
    last = "0-0"
    for _ in range(n):
        t0 = time.monotonic()
        await w.xadd(key, {"b": b"x" * 64})
        resp = await rd.xread({key: last}, block=1000, count=1)
        out.append(time.monotonic() - t0)
        last = resp[0][1][-1][0]
    await w.aclose()
    await rd.aclose()
    return out


async def run(args) -> dict:
    server = EmbeddedRedis()
    server.start()
    engine = AsyncEngine(EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, eviction_policy="lru", device="cpu"))
    await engine.start()
    source = StampingSource(engine)
    pub = CachePublisher(source, "r0", server.url, "127.0.0.1:0", KEYS, signer=SIGNER)
    arrived: dict[bytes, float] = {}
    stop = asyncio.Event()
    try:
        floor = await redis_floor(server.url)
        await pub.start()
        read_task = asyncio.create_task(reader(server.url, arrived, stop))
        rng = random.Random(args.seed)
        sem = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with sem:
                n = rng.randrange(args.min_prompt, args.max_prompt + 1)
                ids = [rng.randrange(256) for _ in range(n)]
                req = EngineRequest(f"q{i}", ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                async for _ in engine.generate(req):
                    pass
                await asyncio.sleep(rng.expovariate(1 / args.think_s))

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(arrived) < len(source.stored_at):
            await asyncio.sleep(0.05)
        stop.set()
        await read_task
    finally:
        await pub.stop()
        await engine.stop()
        server.close()
    lat = [arrived[h] - t for h, t in source.stored_at.items() if h in arrived]
    missing = len(source.stored_at) - len(lat)
    result = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "blocks_stored": len(source.stored_at),
        "blocks_missing": missing,
        "batches": pub.stats.batches,
        "run_s": round(wall, 3),
        "flush_interval_ms": EVENT_FLUSH_INTERVAL_S * 1000,
        "p50_ms": round(statistics.median(lat) * 1000, 2),
        "p99_ms": round(percentile(lat, 99) * 1000, 2),
        "max_ms": round(max(lat) * 1000, 2),
        "redis_floor_p50_ms": round(statistics.median(floor) * 1000, 3),
        "redis_floor_p99_ms": round(percentile(floor, 99) * 1000, 3),
        "target_p99_ms": 100.0,
    }
    result["p99_over_flush_interval"] = round(result["p99_ms"] / result["flush_interval_ms"], 3)
    result["p99_over_redis_floor_p99"] = round(result["p99_ms"] / result["redis_floor_p99_ms"], 1)
    result["meets_target"] = result["p99_ms"] <= 100.0 and missing == 0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=0.01, help="mean pause after each request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/results/event_latency.json")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    for k, v in result.items():
        print(f"{k:>28}: {v}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
