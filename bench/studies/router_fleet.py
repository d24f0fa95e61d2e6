"""Several routers, one cluster: what splitting the traffic over router processes costs
``cache_aware``, and what the terms exchange (``unicache.router.terms_exchange``) gets back.

``RouterFleet`` (this study's own policy, never registered) is K ``cache_aware`` routers
behind one address, as ``--workers K`` or K pods run them: each request goes to a router
drawn at random (seeded; SO_REUSEPORT and a Service spread connections, not by content),
every router imports a session's record from a shared store before routing its turn and
writes it after (``unicache.router.session_store``), and each router's routed events reach
the others ``lag`` requests later (the exchange; live, a batch goes out every 50 ms, so at
an arrival rate of R requests per second the lag is about R / 20 requests) or never
(``lag`` None: each router's churn and footprint terms come from its own share of the
traffic, as before the exchange). With lag 0 the fleet must decide exactly as one router.
The routers' queued sums (``cache_aware``'s queue share) reach the others at once whenever
the exchange is on (``lag`` not None), and never without it.

Per report trace of the suite (``bench.routing_report``'s traces: nothing here is tuned)
and replica count: goodput in u and metrics at u = 0.5 by the report's machinery, for one
router and each fleet variant (``VARIANTS``), unicache eviction everywhere. Summary: the
geometric mean over traces of each variant's goodput over one router's, the lowest ratio,
and the mean token-hit and TTFT p90 differences at u = 0.5.

Writes ``router_fleet.{json,md,png}`` to ``--out-dir``.

Run (from the repository root, niced; about 10 minutes on 2 shared CPUs):
    nice -n 10 .venv/bin/python -m bench.studies.router_fleet [--workers 2]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, save_figure, write_report
from bench.routing_report import GOODPUT_FLOOR_U, Job, add_suite_args, parse_suite_args, report_suite, run_jobs
from unicache.router.routing.base import LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.router.routing.session_affinity import session_key


class RouterFleet(RoutingPolicy):
    """K ``cache_aware`` routers sharing sessions, and their terms after ``lag`` requests
    (None: not at all). See the module docstring.

    Args:
        routers: how many routers (K).
        lag: requests after which a router's routed events reach the others (None: never).
        seed: the router draw's seed.
        **kwargs: each ``CacheAwarePolicy``'s arguments.
    """

    name = "cache_aware"

    def __init__(self, routers: int = 2, lag: int | None = 0, seed: int = 0, **kwargs):
        if routers < 1 or (lag is not None and lag < 0):
            raise ValueError("routers must be >= 1 and lag >= 0 or None")
        self.routers = [CacheAwarePolicy(**kwargs) for _ in range(routers)]
        self.lag = lag
        if lag is not None:
            for p in self.routers:
                p.share_terms()
        self._rng = random.Random(seed)
        self._store: dict[str, object] = {}
        self._queue: deque[tuple[int, int, list]] = deque()  # (delivered at, sender, events)
        self._count = 0
        self._current = 0
        self._sender: dict[str, int] = {}

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        self._current = k = self._rng.randrange(len(self.routers))
        cls = request.cls
        if cls.session_id is not None:
            key = session_key(cls.tenant, cls.session_id)
            record = self._store.get(key)
            if record is not None:
                self.routers[k].import_session(key, record)
        if self.lag is not None:
            # NOTE: the queued sums (queue share) travel without lag here: live they ride
            # the same 50 ms batches as the events.
            peers: dict[str, tuple[int, int]] = {}
            for j, other in enumerate(self.routers):
                if j != k:
                    for rid, (unc, whole) in other.queued_tokens().items():
                        t = peers.get(rid, (0, 0))
                        peers[rid] = (t[0] + unc, t[1] + whole)
            self.routers[k].set_peer_queued(peers)
        return self.routers[k].choose(request, replicas, index)

    def on_request_routed(self, request: RoutingRequest, decision: RouteDecision) -> None:
        k = self._current
        p = self.routers[k]
        p.on_request_routed(request, decision)
        self._sender[request.request_id] = k
        cls = request.cls
        if cls.session_id is not None:
            key = session_key(cls.tenant, cls.session_id)
            self._store[key] = p.export_session(key)
        self._count += 1
        if self.lag is not None:
            self._queue.append((self._count + self.lag, k, p.take_routed()))
        while self._queue and self._queue[0][0] <= self._count:
            _, sender, events = self._queue.popleft()
            for j, other in enumerate(self.routers):
                if j != sender:
                    other.apply_routed(events)

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None:
        k = self._sender.get(request.request_id)
        if k is not None:
            self.routers[k].on_first_token(request, replica_id)

    def on_request_finished(self, request: RoutingRequest, replica_id: str) -> None:
        k = self._sender.pop(request.request_id, None)
        if k is not None:
            self.routers[k].on_request_finished(request, replica_id)

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        for p in self.routers:
            p.update_replicas(replica_ids)

    def on_replica_died(self, replica_id: str) -> None:
        for p in self.routers:
            p.on_replica_died(replica_id)


ONE = "1 router"
# label -> RouterFleet arguments
VARIANTS: dict[str, dict] = {
    "2 routers, exchange lag 0": {"routers": 2, "lag": 0},
    "2 routers, exchange lag 4": {"routers": 2, "lag": 4},
    "2 routers, exchange lag 16": {"routers": 2, "lag": 16},
    "2 routers, no exchange": {"routers": 2, "lag": None},
    "4 routers, exchange lag 4": {"routers": 4, "lag": 4},
    "4 routers, no exchange": {"routers": 4, "lag": None},
}


def summarise(results: list[dict], n: str) -> dict:
    """Per variant: goodput over one router's (geometric mean over traces, lowest), mean
    token-hit and TTFT p90 differences at u_ref, traces decided exactly alike."""
    out = {}
    for label in VARIANTS:
        ratios, hits, p90s, same = [], [], [], 0
        for r in results:
            rows = r["by_replicas"][n]["rows"]
            one, v = rows[ONE], rows[label]
            ratios.append(max(v["goodput_u"], GOODPUT_FLOOR_U) / max(one["goodput_u"], GOODPUT_FLOOR_U))
            hits.append(100.0 * (v["at_u_ref"]["token_hit_ratio"] - one["at_u_ref"]["token_hit_ratio"]))
            p90s.append(v["at_u_ref"]["ttft_p90_s"] / one["at_u_ref"]["ttft_p90_s"])
            same += v["points"] == one["points"]
        out[label] = {"goodput_ratio_geomean": math.exp(statistics.fmean(map(math.log, ratios))),
                      "goodput_ratio_min": min(ratios), "token_hit_pts_mean": statistics.fmean(hits),
                      "ttft_p90_ratio_mean": statistics.fmean(p90s), "traces_identical": same, "traces": len(results)}
    return out


def markdown(report: dict) -> str:
    lines = [f"# Router fleet: K routers against one (commit {report['commit']})", "",
             f"`{report['command']}`; {len(report['traces'])} report traces of the suite, unicache eviction, "
             f"{report['wall_s'] / 60:.1f} min wall.", "",
             "Goodput over one router's: geometric mean over traces (lowest trace); token hit and TTFT p90 at "
             "u = 0.5 against one router's; identical: traces whose every replay matched one router's.", ""]
    for n, rows in report["summary"].items():
        lines += [f"## {n} replicas", "", "| variant | goodput / 1 router (lowest) | token hit pts | TTFT p90 ratio | identical |",
                  "|---|---|---|---|---|"]
        for label, s in rows.items():
            lines.append(f"| {label} | {s['goodput_ratio_geomean']:.3f} ({s['goodput_ratio_min']:.3f}) | "
                         f"{s['token_hit_pts_mean']:+.2f} | {s['ttft_p90_ratio_mean']:.3f} | "
                         f"{s['traces_identical']} of {s['traces']} |")
        lines.append("")
    lines += ["## Per trace (goodput in u)", "", "| trace | replicas | " + " | ".join([ONE, *VARIANTS]) + " |",
              "|---|---|" + "---|" * (len(VARIANTS) + 1)]
    for r in report["results"]:
        for n, block in r["by_replicas"].items():
            cells = [f"{block['rows'][label]['goodput_u']:.3f}" for label in (ONE, *VARIANTS)]
            lines.append(f"| {r['trace']} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = list(VARIANTS)
    width = 0.8 / max(1, len(report["summary"]))
    for i, (n, rows) in enumerate(report["summary"].items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [rows[lb]["goodput_ratio_geomean"] for lb in labels], width, label=f"{n} replicas")
        ax.scatter(xs, [rows[lb]["goodput_ratio_min"] for lb in labels], marker="_", color="black", s=200, zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + width * (len(report["summary"]) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels([lb.replace(", ", "\n") for lb in labels], fontsize=8)
    ax.set_ylabel("goodput / one router's (bar: geomean; dash: lowest trace)")
    ax.set_title("cache_aware split over K routers, with and without the terms exchange")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(ap)
    args = parse_suite_args(ap, argv)
    t0 = time.perf_counter()
    replicas = tuple(int(x) for x in args.replicas.split(","))
    common, traces = report_suite(args)  # the routing report's settings and report traces
    configs = ((ONE, "cache_aware", "unicache"),) + tuple((v, "cache_aware", "unicache") for v in VARIANTS)
    jobs = [Job(t, replicas, configs, dict(VARIANTS), common, {v: RouterFleet for v in VARIANTS}) for t in traces]
    results = run_jobs(jobs, args.workers)
    report = {
        "command": "python -m bench.studies.router_fleet " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(),
        "traces": [t.name for t in traces], "variants": VARIANTS,
        "summary": {str(n): summarise(results, str(n)) for n in replicas},
        "results": results, "wall_s": time.perf_counter() - t0,
    }
    out_dir = Path(args.out_dir)
    write_report(out_dir, "router_fleet", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
