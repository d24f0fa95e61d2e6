"""Where a router's prompt misses come from: blocks cached somewhere it did not send the
request (placement), or blocks no replica had published when it decided (nowhere).

On ``bench.foreign_workload`` traffic the shipped ``cache_aware`` has the higher goodput
but the lower token hit ratio against sglang + unicache (``bench.studies.foreign_traffic``).
This study replays traces at the routing report's u_ref and sorts every admitted
request's prompt blocks three ways:

    * ``hit``: blocks the replica's store matched at admission;
    * ``placement``: not hit, but within the longest prefix the router's index showed on
      any replica when the request was routed (a better placement would have hit them);
    * ``nowhere``: past that prefix: no replica had published them at routing time (new
      blocks, or blocks a request routed earlier was still computing: a request that
      waits in the same replica's queue until that prefill ends matches them, one started
      on an idle lane or another replica computes them again).

Shares are of all prompt blocks over the traces (block-weighted). Configs: the shipped
``cache_aware``, the same with ``track_inflight`` (blocks of unfinished requests count
as held), and sglang + unicache, whose approximate trees insert a prompt when routing it.

Writes ``miss_sources.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced; about 5 min):
    nice -n 10 .venv/bin/python -m bench.studies.miss_sources [--seeds 24] [--replicas 4,8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, produced_by, write_report
from bench.routing_report import LANES, capacity_blocks, nominal_scale
from bench.studies.foreign_traffic import foreign_trace, load_foreign
from bench.workers import map_in_workers
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.timing import TimingModel

CONFIGS = (("cache_aware", "cache_aware", {}), ("cache_aware[track_inflight]", "cache_aware", {"track_inflight": True}),
           ("sglang", "sglang", {}))
CATEGORIES = ("hit", "placement", "nowhere")


class MissSources(Replay):
    """A replay that sorts each admitted request's prompt blocks into ``CATEGORIES``
    (``counts``, in blocks; ``blocks``: every admitted prompt block)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._best_at_route: dict[str, int] = {}
        self.counts = dict.fromkeys(CATEGORIES, 0)
        self.blocks = 0

    def _decide(self, rr, loads):
        # the index as the router sees it for this decision (``_snapshot`` brought it up to date)
        self._best_at_route[rr.request_id] = max(self.index.prefix_matches(rr.block_hashes).values(), default=0)
        return super()._decide(rr, loads)

    def _admit_head(self, rep, t):
        before = self.counters.hit_blocks
        out = super()._admit_head(rep, t)
        if out is not None:
            req = out[0]
            n = len(req.prompt_hashes)
            hit = self.counters.hit_blocks - before
            shown = min(self._best_at_route.pop(req.rid, 0), n)
            self.counts["hit"] += hit
            self.counts["placement"] += max(0, shown - hit)
            self.counts["nowhere"] += n - max(hit, shown)
            self.blocks += n
        return out


def run_trace(job: tuple[int, tuple[int, ...], dict]) -> dict:
    """Every config at every replica count on foreign trace ``seed``, at u_ref."""
    seed, replicas, a = job
    st = foreign_trace(seed)
    trace = load_foreign(st, a)
    cap = capacity_blocks(trace, a["capacity_frac"])
    timing = TimingModel()
    out = {"trace": st.name, "by_replicas": {}}
    for n in replicas:
        scale = a["u_ref"] * nominal_scale(trace, cap, n, timing)
        rows = {}
        for label, router, kwargs in CONFIGS:
            rep = MissSources(trace, ReplayConfig("unicache", cap, replicas=n, router=router, lanes=LANES,
                                                  rate_scale=scale, router_kwargs=kwargs))
            rec = rep.run()
            rows[label] = {"counts": rep.counts, "blocks": rep.blocks, "ttft_p90_s": rec["ttft_p90_s"],
                           "token_hit_ratio": rec["token_hit_ratio"]}
        out["by_replicas"][str(n)] = rows
    print(f"  {st.name}", file=sys.stderr, flush=True)
    return out


def summarise(results: list[dict], n: str) -> dict:
    """Per config: block-weighted shares of each category, mean TTFT p90 over traces."""
    out = {}
    for label, _, _ in CONFIGS:
        rows = [r["by_replicas"][n][label] for r in results]
        total = sum(x["blocks"] for x in rows)
        out[label] = {**{c: sum(x["counts"][c] for x in rows) / total for c in CATEGORIES},
                      "ttft_p90_s_mean": statistics.mean(x["ttft_p90_s"] for x in rows)}
    return out


def markdown(report: dict) -> str:
    lines = ["# Where prompt misses come from", "",
             produced_by(report), "",
             f"{len(report['results'])} `bench.foreign_workload` traces (seeds {report['seeds'][0]}-{report['seeds'][-1]}) "
             f"at u = {report['u_ref']}, unicache eviction. Shares of all admitted prompt blocks: hit; placement (shown "
             "on some replica by the index at routing, not hit); nowhere (no replica had published them).", "",
             "| replicas | config | hit | placement | nowhere | TTFT p90 s (mean over traces) |", "|---|---|---|---|---|---|"]
    for n, by in report["summary"].items():
        for label, s in by.items():
            lines.append(f"| {n} | {label} | {s['hit']:.3f} | {s['placement']:.3f} | {s['nowhere']:.3f} | "
                         f"{s['ttft_p90_s_mean']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--u-ref", type=float, default=0.5)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    replicas = tuple(int(x) for x in args.replicas.split(","))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    common = {"duration": 300.0, "requests_per_s": 1.5, "capacity_frac": 0.02, "u_ref": args.u_ref}
    t0 = time.perf_counter()
    jobs = [(s, replicas, common) for s in seeds]
    results = map_in_workers(run_trace, jobs, args.workers)
    report = {"command": "python -m bench.studies.miss_sources " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "seeds": seeds, "u_ref": args.u_ref, "replicas": list(replicas),
              "summary": {str(n): summarise(results, str(n)) for n in replicas}, "results": results,
              "wall_s": time.perf_counter() - t0}
    write_report(Path(args.out_dir), "miss_sources", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
