"""What an idle router costs: its CPU per second in front of two fake vLLM servers that get
no traffic (polls, timers, event streams: the background work every request pays for at
a low request rate).

One ``unicache router`` (HTTP and gRPC doors, ``cache_aware``, no Redis, auth off) with two
``unicache.testing.fake_vllm`` backends; after ``--settle`` seconds the router's CPU is
read from /proc per thread over ``--seconds`` (clock ticks: 10 ms), and printed per
second in total and per thread.

    python -m bench.router_idle [--seconds 60] [--settle 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from unicache.plumbing.redis_server import free_port
from unicache.testing.fake_vllm import FakeVllm, model_card

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def thread_ticks(pid: int) -> dict[str, int]:
    """Clock ticks (user + system) of each thread of ``pid``, by ``name/tid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        out[f"{name}/{tid}"] = int(fields[11]) + int(fields[12])
    return out


async def measure(seconds: float, settle: float) -> None:
    fakes = [await FakeVllm([model_card("tiny")]).start() for _ in range(2)]
    cmd = [sys.executable, "-m", "unicache.cli.main", "router", "--grpc-port", "0", "--http-port", str(free_port()),
           "--block-size", "16", "--served-model-name", "tiny", "--use-redis", "false", "--log-level", "warning",
           "--insecure-no-tls", "true", "--auth-enabled", "false", *[a for f in fakes for a in ("--backend", f.url)]]
    proc = subprocess.Popen(cmd)
    try:
        await asyncio.sleep(settle)
        if proc.poll() is not None:
            raise SystemExit(f"the router exited with {proc.returncode}")
        before, t0 = thread_ticks(proc.pid), time.monotonic()
        await asyncio.sleep(seconds)
        after, elapsed = thread_ticks(proc.pid), time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(10)
    spent = {name: (ticks - before.get(name, 0)) * TICK_MS for name, ticks in after.items()}
    print(f"idle router CPU: {sum(spent.values()) / elapsed:.2f} ms per second over {elapsed:.0f} s "
          f"(clock ticks of {TICK_MS:g} ms)")
    for name, ms in sorted(spent.items(), key=lambda kv: -kv[1]):
        if ms:
            print(f"  thread {name}: {ms:.0f} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="measured idle time (default 60)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds after start before measuring (default 15)")
    args = p.parse_args(argv)
    asyncio.run(measure(args.seconds, args.settle))


if __name__ == "__main__":
    main()
