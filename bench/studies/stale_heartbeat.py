"""A heartbeat taken before a request finished, read after it (issue 13's live routing):
would an idle override help a client that sends one request at a time? The override
(``IdleOverride`` below, not in production): with nothing left in flight on a replica,
the running, waiting and queued prefill of a heartbeat received less than
``heartbeat_settle_s`` after the finish count 0. The router's ``ClusterView`` takes a
replica's load from its last heartbeat (plus in-flight counts) until the next one.

A live cluster in this process (``unicache.testing.dashboard_stack``: a private
redis-server, whole replicas with the tiny seeded model publishing signed heartbeats once
a second, a ``cache_aware`` router following them through Redis). The client sends
``--requests`` completions one after another, each a prompt of one of ``--families``
shared prefixes (``--prefix-chars`` bytes, the byte tokenizer: one token each) plus a
unique suffix, families drawn at random (seeded). Each request's prompt tokens served from
the cache (``usage.prompt_tokens_details.cached_tokens``) and route reason are recorded.
Replicas beat once a second and the client keeps one of them busy most of the time, so
the heartbeat the router holds when a request arrives was mostly taken while an earlier
one ran.

Variants, each on a fresh cluster, alternating over ``--rounds``:
    * ``heartbeat``: production's ``ClusterView``, the heartbeat's word until the next one.
    * ``override``: ``IdleOverride``. Not adopted: it measured no gain here (see
      ``bench/results/stale_heartbeat.md``), and with routers that do not exchange their
      in-flight counts it would zero the load another router put on a replica.

    .venv/bin/python -m bench.studies.stale_heartbeat [--requests 60] [--families 3]
        [--prefix-chars 256] [--rounds 2] [--out bench/results/stale_heartbeat]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
from collections import Counter
from pathlib import Path

from bench.rounds import round_order
from unicache.router.cluster import ClusterView
from unicache.router.routing.base import ReplicaLoad
from unicache.testing.dashboard_stack import DashboardStack

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = ("heartbeat", "override")


class IdleOverride(ClusterView):
    """``ClusterView`` whose replica, once its last request in flight (every router's, as
    far as this one knows) finished, looks idle until a heartbeat received
    ``heartbeat_settle_s`` later (the subscriber's scan interval plus margin: surely taken
    after the finish) tells its load again."""

    heartbeat_settle_s = 1.25
    _idle_since: dict  # replica id -> clock time its last request finished (set by ``adopt``)

    @classmethod
    def adopt(cls, cluster: ClusterView) -> None:
        """Turn a running router's ``ClusterView`` into this variant."""
        cluster.__class__ = cls
        cluster._idle_since = {}

    def _idle_load(self, rec) -> ReplicaLoad:
        hb = rec.heartbeat
        return ReplicaLoad(rec.replica_id, free_blocks=hb.cache.free_blocks, capacity_blocks=hb.cache.capacity_blocks,
                           in_flight=rec.all_in_flight)

    def upsert(self, replica_id, address, heartbeat=None, static=False, hop_address=""):
        new = super().upsert(replica_id, address, heartbeat, static, hop_address)
        idle = self._idle_since
        since = idle.get(replica_id)
        if since is not None:
            if heartbeat is not None and self.clock() - since >= self.heartbeat_settle_s:
                del idle[replica_id]
            else:
                rec = self.replicas[replica_id]
                self.replace_load(rec, self._idle_load(rec))
        return new

    def finished(self, replica_id: str) -> None:
        super().finished(replica_id)
        rec = self.replicas.get(replica_id)
        if rec is not None and rec.all_in_flight == 0 and rec.heartbeat is not None:
            self._idle_since[replica_id] = self.clock()
            self.replace_load(rec, self._idle_load(rec))


async def run_variant(variant: str, args, seed: int) -> dict:
    st = await DashboardStack.start(num_replicas=args.replicas, routing_policy="cache_aware", num_blocks=args.num_blocks)
    try:
        if variant == "override":
            IdleOverride.adopt(st.app.cluster)
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        prefixes = ["".join(rng.choice(letters) for _ in range(args.prefix_chars)) for _ in range(args.families)]
        cached = prompt = 0
        reasons: Counter = Counter()
        for i in range(args.requests):
            text = rng.choice(prefixes) + f" request {seed}-{i} " + "".join(rng.choice(letters) for _ in range(24))
            resp = await st.complete(text, max_tokens=4)
            usage = resp.json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            prompt += usage["prompt_tokens"]
            reasons[resp.headers["x-unicache-route-reason"]] += 1
        return {"cached_share": cached / prompt, "reasons": dict(reasons)}
    finally:
        await st.close()


async def main_async(args) -> dict:
    rounds = []
    for r in range(args.rounds):
        order = round_order(VARIANTS, r)
        rnd = {}
        for v in order:
            rnd[v] = await run_variant(v, args, seed=r)
            print(f"round {r + 1} {v}: cached share {rnd[v]['cached_share']:.3f}, reasons {rnd[v]['reasons']}", flush=True)
        rounds.append(rnd)
    return {
        "command": "python -m bench.studies.stale_heartbeat " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "rounds": rounds,
        "median_cached_share": {v: statistics.median(rd[v]["cached_share"] for rd in rounds) for v in VARIANTS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--families", type=int, default=3)
    ap.add_argument("--prefix-chars", type=int, default=256)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "stale_heartbeat")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    med = report["median_cached_share"]
    lines = ["# Stale heartbeats and a client sending one request at a time", "",
             f"`{report['command']}` ({report['cpus']} CPUs, load average {report['load_average']:.2f} at the end): share of "
             "prompt tokens served from the cache, each variant on a fresh live cluster per round (same prompts per round).", "",
             "| round | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for i, rd in enumerate(report["rounds"]):
        lines.append(f"| {i + 1} | " + " | ".join(f"{rd[v]['cached_share']:.3f} ({rd[v]['reasons']})" for v in VARIANTS) + " |")
    lines += ["", "median: " + ", ".join(f"{v} {med[v]:.3f}" for v in VARIANTS), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
