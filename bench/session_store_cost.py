"""What sharing session placement through Redis costs one router per session turn.

Each turn of an explicit session costs the router one ``SessionStore.load`` before its
choice (on the request path) and one ``SessionStore.save`` after it (overlapped with the
replica's work, awaited before the first message is passed on). This measures both, one
turn at a time against a private redis-server on loopback, next to a bare Redis ``PING``
through the same client (the floor of any state kept in Redis), in interleaved rounds:
wall time (latency) and this process's CPU time per call, medians over rounds. Records
hold the turn's prompt hashes (``--blocks`` per prompt, 16 bytes each).

    .venv/bin/python -m bench.session_store_cost [--turns 2000] [--rounds 5] [--blocks 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path


async def run(args) -> dict:
    import redis.asyncio as aioredis

    from unicache.plumbing.redis_server import EmbeddedRedis
    from unicache.router.routing.base import SessionRecord
    from unicache.router.cluster.session_store import SessionStore
    from unicache.contract.state_auth import parse_cluster_key

    server = EmbeddedRedis()
    server.start()
    client = aioredis.from_url(server.url)
    store = SessionStore(client, "bench", parse_cluster_key("ab" * 32), timeout_s=1.0)
    hashes = [os.urandom(16) for _ in range(args.blocks)]
    record = SessionRecord("r1", hashes, True)

    async def ping(i: int) -> None:
        await client.ping()

    async def load(i: int) -> None:
        assert await store.load(f"t\x1fs{i}") is not None

    async def save(i: int) -> None:
        assert await store.save(f"t\x1fs{i}", record)

    for i in range(args.turns):  # every session exists before the timed loads
        await save(i)
    ops = {"redis_ping": ping, "session_load": load, "session_save": save}
    rounds = []
    try:
        for r in range(args.rounds):
            rnd = {}
            names = list(ops)[r % 3:] + list(ops)[: r % 3]
            for name in names:
                w0, c0 = time.perf_counter(), time.process_time()
                for i in range(args.turns):
                    await ops[name](i)
                rnd[name] = {"wall_us": round(1e6 * (time.perf_counter() - w0) / args.turns, 1),
                             "cpu_us": round(1e6 * (time.process_time() - c0) / args.turns, 1)}
            for name in ("session_load", "session_save"):
                rnd[name]["ratio_wall_vs_ping"] = round(rnd[name]["wall_us"] / rnd["redis_ping"]["wall_us"], 3)
            rounds.append(rnd)
    finally:
        await client.aclose()
        server.close()
    med = {name: {k: round(statistics.median(r[name][k] for r in rounds), 3) for k in rounds[0][name]} for name in ops}
    turn = {k: round(med["session_load"][k] + med["session_save"][k], 1) for k in ("wall_us", "cpu_us")}
    return {"config": {"turns": args.turns, "rounds": args.rounds, "blocks": args.blocks,
                       "record_bytes": len(store.encode("t\x1fs0", record)[1])},
            "rounds": rounds, "median": med, "per_turn": turn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    for name, m in out["median"].items():
        print(f"{name:<13} wall {m['wall_us']:8.1f} us  CPU {m['cpu_us']:8.1f} us"
              + (f"  ({m['ratio_wall_vs_ping']}x a PING)" if "ratio_wall_vs_ping" in m else ""))
    print(f"per session turn (load + save, {out['config']['record_bytes']} B records): "
          f"wall {out['per_turn']['wall_us']} us, router CPU {out['per_turn']['cpu_us']} us")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
