"""Where issue 4's remaining gap lies: placement loss against eviction loss, measured.

The routing target compares ``cache_aware`` routing with ``unicache`` eviction on 4
replicas x 1% of the generated mix's unique blocks against the pooled ``opt`` limit (one
replica holding all the capacity, Belady eviction). That distance has two parts, and
this script separates them by replaying the same traces (``unicache.sim``, the same
``Replay`` as ``unicache sim``) on a grid:

    placement  pooled            one store with 4x the capacity (no placement at all)
               cache_aware       ours
               tenant_partition  tenant i always on replica i mod 4: a perfect partition
                                 of this workload, whose tenants share no block (each has
                                 its own salt); bench-only, it ignores load
    eviction   lru, unicache, opt

plus ``sglang`` + ``lru`` (the target's baseline). ``opt`` on a placement is the best any
eviction can do there, so

    * pooled opt - cache_aware opt = what placement alone costs (no eviction can win it back);
    * cache_aware opt - cache_aware unicache = what eviction leaves on that placement.

Second, the cache's content over time (seed 0, pooled, unicache against opt): every 50
arrivals the cached blocks are sorted by task and by the time to their next use (from
the trace), averaged over the samples. Blocks with no next use are dead weight.

Writes ``routing_gap.json``, ``routing_gap.md`` and ``routing_gap.png`` to ``--out-dir``.

Run (from the repository root):
    .venv/bin/python -m bench.studies.routing_gap [--seeds 0,1,2] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.replica.eviction.opt import FutureAccesses
from unicache.sim.prepare import PreparedTrace, future_accesses
from unicache.sim.replay import Replay, ReplayConfig
from bench.paths import RESULTS
from bench.mix_traces import prepared_mix
from bench.report_files import save_figure, write_report

PLACEMENTS = ("pooled", "cache_aware", "tenant_partition")
EVICTIONS = ("lru", "unicache", "opt")
NEXT_USE_BUCKETS = ((10.0, "<10 s"), (60.0, "10-60 s"), (300.0, "60-300 s"), (float("inf"), ">300 s"))
DEAD = "never"


class TenantPartition(RoutingPolicy):
    """Tenant ``...k`` -> the k-th replica (sorted by id), mod the replica count.

    Bench-only: it ignores load and locality; on the generated mix (tenants named
    ``tenant0..``) it is a perfect partition, since tenants never share a block.
    """

    name = "tenant_partition"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        ordered = sorted(r.replica_id for r in replicas)
        digits = "".join(ch for ch in request.cls.tenant if ch.isdigit()) or "0"
        return RouteDecision(ordered[int(digits) % len(ordered)], "tenant")


def run_one(trace: PreparedTrace, cap: int, placement: str, eviction: str, replicas: int,
            future: FutureAccesses | None) -> Replay:
    """A ready-to-run replay of one grid cell (``sglang`` is a placement here too)."""
    if placement == "pooled":
        cfg = ReplayConfig(eviction, cap, replicas=replicas, pooled=True)
    else:
        router = "round_robin" if placement == "tenant_partition" else placement
        cfg = ReplayConfig(eviction, cap, replicas=replicas, router=router)
    rp = Replay(trace, cfg, future=future)
    if placement == "tenant_partition":
        rp.router = TenantPartition()
        rp.router.update_replicas([r.replica_id for r in rp.replicas])
    return rp


def grid(trace: PreparedTrace, cap: int, replicas: int) -> dict[str, dict]:
    future = future_accesses(trace)
    cells = [(p, e) for p in PLACEMENTS for e in EVICTIONS] + [("sglang", "lru")]
    out = {}
    for placement, eviction in cells:
        rec = run_one(trace, cap, placement, eviction, replicas, future if eviction == "opt" else None).run()
        out[f"{placement}+{eviction}"] = {k: rec[k] for k in ("token_hit_ratio", "block_hit_ratio", "per_task",
                                                              "ttft_mean_s", "ttft_p99_s") if k in rec}
        out[f"{placement}+{eviction}"]["load_imbalance"] = rec.get("load_imbalance", 1.0)
        print(f"    {placement:17s} {eviction:9s} token hits {100 * rec['token_hit_ratio']:6.2f}%", file=sys.stderr)
    return out


def composition(trace: PreparedTrace, cap: int, replicas: int, eviction: str, every: int = 50) -> dict[str, dict[str, float]]:
    """Mean cached blocks per (task of the block's first reader, time to its next use)."""
    uses: dict = defaultdict(list)
    owner: dict = {}
    for r in trace.requests:
        for h in r.prompt_hashes:
            uses[h].append(r.arrival_s)
            owner.setdefault(h, r.task_key)
    future = future_accesses(trace) if eviction == "opt" else None
    rp = run_one(trace, cap, "pooled", eviction, replicas, future)
    store = rp.replicas[0].store
    counts: Counter = Counter()
    samples = 0
    arrive = rp._arrive

    def sampled_arrive(req, t):  # NOTE: wraps the replay's arrival hook to sample the cache
        nonlocal samples
        if req.index % every == every - 1:
            samples += 1
            for h in store.cached_hashes():
                times = uses.get(h, ())
                i = bisect.bisect_right(times, t)
                label = DEAD
                if i < len(times):
                    gap = times[i] - t
                    label = next(name for edge, name in NEXT_USE_BUCKETS if gap < edge)
                counts[(owner.get(h, "output"), label)] += 1
        arrive(req, t)

    rp._arrive = sampled_arrive
    rp.run()
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for (task, label), n in sorted(counts.items()):
        table[task][label] = n / max(1, samples)
    return dict(table)


def mean_over(runs: list[dict[str, dict]]) -> dict[str, float]:
    return {cell: sum(r[cell]["token_hit_ratio"] for r in runs) / len(runs) for cell in runs[0]}


def markdown(report: dict) -> str:
    m = report["mean_token_hit_ratio"]
    seeds = ", ".join(str(s) for s in report["seeds"])
    lines = [f"# Where the routing gap lies\n\nProduced by `{report['command']}` ({report['cpus']} CPUs). Generated mix, "
             f"seeds {seeds}, {report['replicas']} replicas x {100 * report['capacity_frac']:g}% of unique blocks each; "
             "token hit %, mean over seeds.\n",
             "| placement | " + " | ".join(EVICTIONS) + " |", "|---|" + "---|" * len(EVICTIONS)]
    for p in PLACEMENTS:
        lines.append(f"| {p} | " + " | ".join(f"{100 * m[f'{p}+{e}']:.2f}" for e in EVICTIONS) + " |")
    lines.append(f"| sglang | {100 * m['sglang+lru']:.2f} | | |\n")
    d = report["decomposition"]
    lines += ["Gap of the routing target, sglang+lru to pooled opt, in token-hit points:\n",
              f"- whole gap: {d['whole_gap']:.2f}; cache_aware+unicache closes {d['closed']:.2f} "
              f"({d['closed_share']:.3f} of it; target 0.5).",
              f"- placement alone (pooled opt - cache_aware opt): {d['placement_loss']:.2f}.",
              f"- eviction on that placement (cache_aware opt - cache_aware unicache): {d['eviction_loss']:.2f}.",
              f"- eviction without placement (pooled opt - pooled unicache): {d['pooled_eviction_loss']:.2f}.",
              f"- the best possible closed share with cache_aware placement (its opt cell): {d['placement_ceiling']:.2f}.\n",
              f"## Cache content, seed {report['seeds'][0]}, pooled: mean cached blocks by next use\n",
              "| eviction | task | " + " | ".join(name for _, name in NEXT_USE_BUCKETS) + f" | {DEAD} |",
              "|---|---|" + "---|" * (len(NEXT_USE_BUCKETS) + 1)]
    for ev, table in report["composition"].items():
        for task, row in table.items():
            cols = [name for _, name in NEXT_USE_BUCKETS] + [DEAD]
            lines.append(f"| {ev} | {task} | " + " | ".join(f"{row.get(c, 0.0):.0f}" for c in cols) + " |")
    dead = {ev: sum(row.get(DEAD, 0.0) for row in t.values()) for ev, t in report["composition"].items()}
    total = {ev: sum(sum(row.values()) for row in t.values()) for ev, t in report["composition"].items()}
    lines.append("\nDead blocks (no later reader) held on average: "
                 + ", ".join(f"{ev} {dead[ev]:.0f} of {total[ev]:.0f}" for ev in dead)
                 + ". Blocks of requests still running are pinned and count here too.\n")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Grouped bars: token hit % per placement, one bar per eviction policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report["mean_token_hit_ratio"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(EVICTIONS)
    for i, e in enumerate(EVICTIONS):
        ax.bar([x + i * width for x in range(len(PLACEMENTS))], [100 * m[f"{p}+{e}"] for p in PLACEMENTS], width, label=e)
    ax.axhline(100 * m["sglang+lru"], color="grey", ls="--", lw=1, label="sglang + lru")
    ax.set_xticks([x + width * (len(EVICTIONS) - 1) / 2 for x in range(len(PLACEMENTS))], PLACEMENTS)
    ax.set_ylabel("token hit ratio (%)")
    ax.set_title(f"generated mix, {report['replicas']} replicas x {100 * report['capacity_frac']:g}%, mean of seeds")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="gen-workload seeds (default 0,1,2)")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--capacity-frac", type=float, default=0.01, help="per replica, of unique blocks")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, comp = [], {}
    for k, seed in enumerate(seeds):
        t0 = time.perf_counter()
        trace, cap = prepared_mix(seed, args.duration, args.block_size, args.capacity_frac)
        print(f"[seed {seed}] {len(trace.requests)} requests, {cap} blocks per replica", file=sys.stderr)
        runs.append(grid(trace, cap, args.replicas))
        if k == 0:
            comp = {ev: composition(trace, cap, args.replicas, ev) for ev in ("unicache", "opt")}
        print(f"[seed {seed}] {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    m = mean_over(runs)
    base, limit = m["sglang+lru"], m["pooled+opt"]
    whole = 100 * (limit - base)
    report = {
        "command": "python -m bench.studies.routing_gap " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(),
        "seeds": seeds, "replicas": args.replicas, "capacity_frac": args.capacity_frac,
        "per_seed": dict(zip(map(str, seeds), runs)),
        "mean_token_hit_ratio": m,
        "decomposition": {
            "whole_gap": whole,
            "closed": 100 * (m["cache_aware+unicache"] - base),
            "closed_share": (m["cache_aware+unicache"] - base) / (limit - base),
            "placement_loss": 100 * (limit - m["cache_aware+opt"]),
            "eviction_loss": 100 * (m["cache_aware+opt"] - m["cache_aware+unicache"]),
            "pooled_eviction_loss": 100 * (limit - m["pooled+unicache"]),
            "placement_ceiling": (m["cache_aware+opt"] - base) / (limit - base),
        },
        "composition": comp,
    }
    write_report(out_dir, "routing_gap", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
