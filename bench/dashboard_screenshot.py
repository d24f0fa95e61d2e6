"""The README's dashboard screenshot: a live two-replica cluster (unicache.testing.dashboard_stack),
a mixed workload for ``--seconds`` (chat sessions that grow turn by turn, requests sharing
a template, one-off prompts), the router's history sampled every ``--interval-s``, then
headless Chromium writes the page as a PNG.

    .venv/bin/python -m bench.dashboard_screenshot            # -> docs/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from unicache.testing.browser import find_chromium, screenshot
from unicache.testing.dashboard_stack import DashboardStack

TEMPLATE = "You are a careful assistant. Answer in one short sentence, cite nothing, stay polite. " * 2
MAX_SESSION_CHARS = 400  # bytes = tokens: well within one replica's pool (96 blocks x 8)
WORDS = "cache prefix block router replica session token queue evict warm cold hit miss".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def workload(st: DashboardStack, seconds: float, interval_s: float, seed: int) -> int:
    rng = random.Random(seed)
    sessions = {f"chat-{i}": words(rng, 12) for i in range(6)}
    sent = 0
    end = time.monotonic() + seconds
    next_sample = time.monotonic()
    while time.monotonic() < end:
        kind = rng.random()
        if kind < 0.45:
            sid = rng.choice(sorted(sessions))
            sessions[sid] += " " + words(rng, 6)
            if len(sessions[sid]) > MAX_SESSION_CHARS:  # the session ends; a new one starts
                del sessions[sid]
                sid = f"chat-{sent}"
                sessions[sid] = words(rng, 12)
            resp = await st.client.post(
                "/v1/completions", json={"prompt": sessions[sid], "max_tokens": 4}, headers={"x-session-id": sid}
            )
            resp.raise_for_status()
        elif kind < 0.8:
            await st.complete(TEMPLATE + words(rng, 5))
        else:
            await st.complete(words(rng, 40))
        sent += 1
        if time.monotonic() >= next_sample:
            st.sample()
            next_sample += interval_s
    return sent


async def main_async(args) -> None:
    if find_chromium() is None:
        raise SystemExit("needs chromium (apt-get install chromium)")
    st = await DashboardStack.start(num_replicas=2, routing_policy=args.routing_policy, num_blocks=args.num_blocks)
    try:
        st.app.history.points.clear()
        st.app.history.interval_s = args.interval_s  # what the page states; this script samples
        sent = await workload(st, args.seconds, args.interval_s, args.seed)
        st.sample()
        await screenshot(st.url + "/dashboard", args.out, width=args.width, height=args.height)
    finally:
        await st.close()
    print(f"{sent} requests, {len(st.app.history.points)} history points -> {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="workload duration (default 60)")
    p.add_argument("--interval-s", type=float, default=1.0, help="history sampling period (default 1 s)")
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks per replica (small: evictions show)")
    p.add_argument("--routing-policy", default="cache_aware")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1450)
    p.add_argument("--out", default="docs/dashboard.png")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
