"""RSS of the router over a soak of N requests (default 1,000,000) through its classify +
route + bookkeeping path, in process, against the configured memory budget.

What is soaked: a real ``RouterApp`` (not started: no sockets) with four static replicas
and the default policy (``cache_aware``) and classifier. Per request: ``RouterCore.prepare``
(hash the token ids salted by tenant, classify), ``RouterCore.choose`` (the policy over
the locality index), the bookkeeping ``_attempt`` does (in-flight count, ``on_request_routed``,
the decision metric, ``on_first_token``), the request's finish (``on_request_finished``, in-flight count),
and the chosen replica's stored-block events applied to the index, as the Redis
subscriber would (the index trims each replica to ``max_index_blocks``, here its
``--index-blocks``, default 32,768: replicas of 512k cached tokens). Not soaked: sockets, gRPC/HTTP framing, Redis (the shared session
store is off), replica calls. Those hold per-request state only while a request is in
flight (``max_in_flight`` bounds it).

Workload (seeded): 8 tenants; 40% turns of explicit sessions (a new session every 6 turns,
each turn adding 2-8 blocks to its prompt), 30% templated single-turn requests (one of 2,000
templates of 8-64 blocks plus a 1-4 block unique suffix), 30% unique prompts of 4-64 blocks;
block size 16. Every session id and unique prompt is new, so every table fills to its cap.

Reports RSS (VmRSS) every ``--sample-every`` requests with each table's entry count,
the peak, and each table's cap with its bytes per entry (``unicache.router.memory``);
writes ``bench/results/router_soak.{json,md,png}``.

    nice -n 10 .venv/bin/python -m bench.router_soak [--requests 1000000] [--sample-every 20000]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import random
import time

from unicache.testing.procfs import rss_kib
from bench.paths import RESULTS
from bench.report_files import save_figure, write_report

BS = 16
TENANTS = [f"tenant{i}" for i in range(8)]


def tokens_of(block_ids: list[int]) -> list[int]:
    out: list[int] = []
    for b in block_ids:
        base = (b * BS) % 2_000_000_000
        out.extend(range(base, base + BS))
    return out


class Workload:
    """The seeded request stream (see the module docstring): yields (tenant, token ids,
    session id or None)."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.next_block = 1 << 20
        self.templates = [self._fresh(self.rng.randint(8, 64)) for _ in range(2000)]
        self.template_tenant = [self.rng.choice(TENANTS) for _ in self.templates]
        self.sessions: list[list] = []  # [tenant, session id, block ids, turns left]
        self.next_session = 0

    def _fresh(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def next(self) -> tuple[str, list[int], str | None]:
        rng = self.rng
        x = rng.random()
        if x < 0.4:
            if len(self.sessions) < 64:
                self.next_session += 1
                self.sessions.append([rng.choice(TENANTS), f"s{self.next_session}", self._fresh(rng.randint(4, 32)), 6])
            i = rng.randrange(len(self.sessions))
            s = self.sessions[i]
            s[2] = s[2] + self._fresh(rng.randint(2, 8))
            s[3] -= 1
            if s[3] == 0:
                self.sessions[i] = self.sessions[-1]
                self.sessions.pop()
            return s[0], tokens_of(s[2]), s[1]
        if x < 0.7:
            t = rng.randrange(len(self.templates))
            return self.template_tenant[t], tokens_of(self.templates[t] + self._fresh(rng.randint(1, 4))), None
        return rng.choice(TENANTS), tokens_of(self._fresh(rng.randint(4, 64))), None


def build_app(budget_mib: int, index_blocks: int):
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config

    cfg = build_config(env={}, overrides={
        "use_redis": False, "auth_enabled": False, "replicas": ",".join(f"r{i}=127.0.0.1:{9000 + i}" for i in range(4)),
        "block_size": BS, "memory_budget_mib": budget_mib, "max_index_blocks": index_blocks,
    })
    app = RouterApp(cfg)
    app.cluster.redis_connected = True  # the index is live (fed below), as with Redis up
    return app


def table_sizes(app) -> dict[str, int]:
    from unicache.router.memory import table_entries

    return table_entries(app)


def soak(args) -> dict:
    from unicache.router.request_path.core import Labelled

    app = build_app(args.budget_mib, args.index_blocks)
    core, cluster, policy, index, metrics = app.core, app.cluster, app.policy, app.index, app.metrics
    wl = Workload(args.seed)
    pid = os.getpid()
    samples = [{"requests": 0, "rss_mib": round(rss_kib(pid) / 1024, 1), "tables": table_sizes(app), "s": 0.0}]
    t0 = time.perf_counter()
    for i in range(1, args.requests + 1):
        tenant, ids, sid = wl.next()
        prep = core.prepare(tenant, ids, Labelled(session_id=sid))
        decision = core.choose(prep.routing, set(), prep.prepare_s)
        rid = decision.replica_id
        cluster.started(rid)
        policy.on_request_routed(prep.routing, decision)
        metrics.labelled(metrics.decisions, decision.reason, rid).inc()
        policy.on_first_token(prep.routing, rid)
        hashes = prep.routing.block_hashes
        index.apply_events_unchecked(rid, hashes[decision.matched_blocks:], [])
        cluster.finished(rid)
        policy.on_request_finished(prep.routing, rid)
        if i % args.sample_every == 0:
            samples.append({"requests": i, "rss_mib": round(rss_kib(pid) / 1024, 1), "tables": table_sizes(app),
                            "s": round(time.perf_counter() - t0, 1)})
            print(f"{i:>9} requests  RSS {samples[-1]['rss_mib']:7.1f} MiB  {samples[-1]['tables']}", flush=True)
    from unicache.router.memory import index_bytes_per_entry, table_caps

    return {
        "index_bytes_per_entry": index_bytes_per_entry(index),
        "config": {"requests": args.requests, "seed": args.seed, "budget_mib": args.budget_mib, "block_size": BS,
                   "max_index_blocks": args.index_blocks,
                   "replicas": 4, "policy": policy.name},
        "samples": samples,
        "peak_rss_mib": max(s["rss_mib"] for s in samples),
        "caps": table_caps(app),
    }


def markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        f"Soak of {c['requests']:,} requests through classify + route + bookkeeping (in process, policy {c['policy']}, "
        f"{c['replicas']} replicas, seed {c['seed']}): peak RSS **{r['peak_rss_mib']} MiB**, budget {c['budget_mib']} MiB.",
        "", "| table | entries at the end | cap (entries) | bytes per entry (measured) | cap MiB (at router/memory.py's bound per entry) |",
        "|---|---|---|---|---|",
    ]
    end = r["samples"][-1]["tables"]
    for name, cap in r["caps"].items():
        lines.append(f"| {name} | {end.get(name, 0):,} | {cap['entries']:,} | {cap['bytes_per_entry']} | {cap['mib']:.1f} |")
    lines.append(f"| index (per replica cap: max_index_blocks) | {end.get('index', 0):,} | {c['max_index_blocks']:,} x "
                 f"{c['replicas']} | {r['index_bytes_per_entry']} | "
                 f"{c['max_index_blocks'] * c['replicas'] * r['index_bytes_per_entry'] / 2**20:.1f} (measured) |")
    lines += ["", "| requests | RSS MiB |", "|---|---|"]
    step = max(1, len(r["samples"]) // 10)
    for s in r["samples"][::step] + ([r["samples"][-1]] if (len(r["samples"]) - 1) % step else []):
        lines.append(f"| {s['requests']:,} | {s['rss_mib']} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [s["requests"] for s in r["samples"]]
    ax.plot(xs, [s["rss_mib"] for s in r["samples"]], label="router RSS")
    ax.axhline(r["config"]["budget_mib"], color="red", linestyle="--", label="budget")
    ax.set_xlabel("requests")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, r["config"]["budget_mib"] * 1.15)
    ax.set_title("Router RSS over the soak (classify + route + bookkeeping)")
    ax.legend(loc="lower right")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--sample-every", type=int, default=20_000)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index-blocks", type=int, default=32768,
                    help="max_index_blocks (per replica): a replica of 32,768 blocks x 16 tokens caches 512k tokens")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args()
    r = soak(args)
    out = Path(args.out_dir)
    write_report(out, "router_soak", r, markdown(r), plot)


if __name__ == "__main__":
    main()
