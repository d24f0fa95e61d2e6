"""Load imbalance against goodput: can a balance rule bound ``cache_aware``'s imbalance
without losing what locality earns?

The suite report's load imbalance (``unicache.sim.replay``) is max / mean over replicas
of the prefill tokens each replica *computed* (uncached prompt tokens) over the whole
trace, at u = 0.5, and a family's figure is the max over its traces. With explicit
sessions kept on their replica, a session's every turn computes where its first turn
went, so the figure is a bin-packing of sessions: the *session-atomic bound* below is the
imbalance of the best packing that never splits a session (largest sessions first onto
the least-loaded replica, the rest of the work poured level; taken from the default
policy's own per-session computed tokens, so it is an estimate). Where one session alone
computes more than 1.2 x a replica's mean share, no placement that keeps sessions home
meets the issue's 1.2.

The variants (``VARIANTS``; this study's own ``BalancePolicy``, a ``CacheAwarePolicy``
subclass, never registered) add a hard balance rule to TTFT admission. With ``w_r`` the
policy's decayed record of uncached tokens routed to r (``_inflow``, the churn term's;
the router's estimate of what r computed) and ``new_r`` the request's uncached tokens on
r by the index, a replica is admissible only while

    w_r + new_r <= max(beta * (sum_r' w_r' + min_r' new_r') / n, min_r' (w_r' + new_r'))

(its work after taking the request within ``beta`` of the mean after placement; the
least-work replica always qualifies). ``hard`` applies it to every request, so a
session leaves a home that ran ahead (recomputing its context elsewhere); ``free``
applies it only where no session home is kept (new sessions, single-turn requests), so
sessions never move for balance. The admissible set is the TTFT set's members that pass;
if none does, the balance rule's own set.

Tuning traces only, the admission study's (``bench.studies.routing_admission``): suite
points 1000-1003 of each generated family with seed 1000, Mooncake slices 0-1 of 8; none
is a report trace of ``bench.routing_report``. Per trace, replica count and variant:
goodput in u and metrics at u = 0.5 by the report's machinery, against sglang + unicache
and sglang + lru. The session-atomic bound is also computed for the report traces (it
explains their figures; nothing is chosen on it).

Writes ``routing_balance.{json,md,png}`` (the PNG: goodput against max imbalance per
variant, the trade-off curve) to ``--out-dir``.

Run (from the repository root, niced; about 10 minutes on 2 shared CPUs):
    nice -n 10 .venv/bin/python -m bench.studies.routing_balance [--workers 2]
"""

from __future__ import annotations

import collections
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, save_figure, write_report
from bench.routing_report import GOODPUT_FLOOR_U, LANES, Job, capacity_blocks, nominal_scale, run_jobs
from bench.studies.routing_admission import parse_tuning_run
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.router.routing.session_affinity import session_key
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.suite import SuiteTrace, load_suite_trace, suite_traces
from unicache.sim.timing import TimingModel

SGL_UC, SGL_LRU = "sglang+unicache", "sglang+lru"


class BalancePolicy(CacheAwarePolicy):
    """``cache_aware`` with the hard balance rule of the module docstring.

    Args:
        beta: a replica's work after the request may be at most this times the mean.
        sessions_move: True (``hard``): the rule also decides whether a session stays
            home; False (``free``): a session home is judged by TTFT admission alone.
    """

    def __init__(self, beta: float = 1.2, sessions_move: bool = True, **kwargs):
        super().__init__(**kwargs)
        if not beta >= 1.0:
            raise ValueError("beta must be >= 1")
        self.beta = beta
        self.sessions_move = sessions_move
        self._ttft_set: list[ReplicaLoad] | None = None

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        adm = super()._admissible(replicas, n_tokens, block_size, matches)
        self._ttft_set = adm
        inflow = self._inflow
        if not inflow:
            return adm
        after = {r.replica_id: inflow.get(r.replica_id, 0.0) + max(0, n_tokens - block_size * matches.get(r.replica_id, 0))
                 for r in replicas}
        lo = min(after.values())
        total = sum(inflow.get(r.replica_id, 0.0) for r in replicas) + min(
            max(0, n_tokens - block_size * matches.get(r.replica_id, 0)) for r in replicas)
        cap = max(self.beta * total / len(replicas), lo)
        ok = [r for r in adm if after[r.replica_id] <= cap]
        return ok or [r for r in replicas if after[r.replica_id] <= cap]

    def _session_home(self, prev, hashes, admissible, index, matches):
        if not self.sessions_move and self._ttft_set is not None:
            admissible = self._ttft_set
        return super()._session_home(prev, hashes, admissible, index, matches)


# name -> (router class, keyword arguments)
VARIANTS: dict[str, tuple[type[CacheAwarePolicy], dict]] = {
    "default (no balance rule)": (CacheAwarePolicy, {}),
    "hard 1.5": (BalancePolicy, {"beta": 1.5}),
    "hard 1.2": (BalancePolicy, {"beta": 1.2}),
    "free 1.5": (BalancePolicy, {"beta": 1.5, "sessions_move": False}),
    "free 1.2": (BalancePolicy, {"beta": 1.2, "sessions_move": False}),
}
BASE = "default (no balance rule)"
TARGET = 1.2


def _lg(row: dict) -> float:
    return math.log(max(row["goodput_u"], GOODPUT_FLOOR_U))


def summarise(results: list[dict], n: str) -> dict:
    """Per variant: goodput ratios (geometric mean of paired per-trace ratios), token-hit
    points vs sglang+unicache, max and mean imbalance at u = 0.5, traces within 1.2."""
    out: dict[str, dict] = {}
    for v in [*VARIANTS, SGL_UC, SGL_LRU]:
        rows = [r["by_replicas"][n]["rows"] for r in results]
        imb = [x[v]["at_u_ref"]["load_imbalance"] for x in rows]
        out[v] = {
            "goodput_vs_sglang_unicache": math.exp(statistics.mean(_lg(x[v]) - _lg(x[SGL_UC]) for x in rows)),
            "goodput_vs_sglang_lru": math.exp(statistics.mean(_lg(x[v]) - _lg(x[SGL_LRU]) for x in rows)),
            "goodput_vs_base": math.exp(statistics.mean(_lg(x[v]) - _lg(x[BASE]) for x in rows)),
            "hit_pts_vs_sglang_unicache": 100 * statistics.mean(
                x[v]["at_u_ref"]["token_hit_ratio"] - x[SGL_UC]["at_u_ref"]["token_hit_ratio"] for x in rows),
            "imbalance_max": max(imb), "imbalance_mean": statistics.mean(imb),
            "traces_within_target": sum(i <= TARGET for i in imb), "traces": len(rows),
        }
    return out


class _Recording(Replay):
    """A replay that records each request's replica and the blocks its allocation hit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replica_of: dict[str, str] = {}
        self.hit_blocks: dict[str, int] = {}
        for rep in self.replicas:
            allocate = rep.store.allocate

            def recorded(rid, *a, _allocate=allocate, **kw):
                alloc = _allocate(rid, *a, **kw)
                self.hit_blocks[rid] = alloc.num_hit_blocks
                return alloc

            rep.store.allocate = recorded

    def _decide(self, request, loads):
        d = super()._decide(request, loads)
        self.replica_of[request.request_id] = d.replica_id
        return d


def session_atomic_bound(st: SuiteTrace, replicas: int, common: dict, u: float = 0.5) -> dict:
    """The default policy's replay of ``st`` at ``u``, and the imbalance of the best
    placement of its per-session computed tokens that never splits a session (module
    docstring)."""
    timing = TimingModel()
    trace = load_suite_trace(st, mooncake_path=common["mooncake"], mooncake_slices=common["mooncake_slices"],
                             duration=common["duration"], requests_per_s=common["requests_per_s"])
    cap = capacity_blocks(trace, common["capacity_frac"])
    cfg = ReplayConfig("unicache", cap, replicas=replicas, router="cache_aware", lanes=LANES,
                       rate_scale=u * nominal_scale(trace, cap, replicas, timing))
    rp = _Recording(trace, cfg)
    rec = rp.run()
    sessions: collections.Counter[str] = collections.Counter()
    total = 0.0
    for r in trace.requests:
        if r.rid not in rp.replica_of:
            continue
        computed = r.input_length - min(rp.hit_blocks.get(r.rid, 0) * trace.block_size, r.input_length)
        total += computed
        if r.cls.session_id is not None:
            sessions[session_key(r.cls.tenant, r.cls.session_id)] += computed
    mean = total / replicas if total else 1.0
    bins = [0.0] * replicas
    for w in sorted(sessions.values(), reverse=True):
        i = min(range(replicas), key=bins.__getitem__)
        bins[i] += w
    level = _pour(bins, total - sum(sessions.values()))
    return {"trace": st.name, "family": st.family, "role": st.role, "replicas": replicas,
            "imbalance_default": rec["load_imbalance"], "sessions": len(sessions),
            "session_share": sum(sessions.values()) / total if total else 0.0,
            "largest_session_vs_mean": max(sessions.values(), default=0.0) / mean,
            "session_atomic_bound": max(max(bins), level) / mean}


def _pour(bins: list[float], amount: float) -> float:
    """The level divisible work ``amount`` fills the lowest ``bins`` to (water filling)."""
    b = sorted(bins)
    level = b[0]
    for k in range(1, len(b) + 1):
        nxt = b[k] if k < len(b) else math.inf
        need = (nxt - level) * k
        if need >= amount:
            return level + amount / k
        amount -= need
        level = nxt
    return level


def markdown(report: dict) -> str:
    lines = [
        "# cache_aware: load imbalance against goodput (tuning traces only)\n",
        f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs, {report['workers']} workers) "
        f"at commit {report['commit']}; {report['wall_s'] / 60:.1f} min wall.\n",
        f"Tuning traces ({len(report['traces'])}): {', '.join(report['traces'])}. Imbalance = max / mean computed "
        "prefill tokens per replica at u = 0.5; goodput ratios are geometric means of paired per-trace ratios; "
        f"'within' counts traces with imbalance <= {TARGET}.\n",
    ]
    for n, s in report["summary"].items():
        lines += [f"## {n} replicas\n",
                  "| variant | goodput / sglang+uc | / sglang+lru | / default | hit pts vs sglang+uc | imbalance max "
                  "| imbalance mean | within 1.2 |", "|---|---|---|---|---|---|---|---|"]
        for v, d in s.items():
            lines.append(f"| {v} | {d['goodput_vs_sglang_unicache']:.3f} | {d['goodput_vs_sglang_lru']:.3f} "
                         f"| {d['goodput_vs_base']:.3f} | {d['hit_pts_vs_sglang_unicache']:+.2f} "
                         f"| {d['imbalance_max']:.2f} | {d['imbalance_mean']:.3f} "
                         f"| {d['traces_within_target']}/{d['traces']} |")
        lines.append("")
    lines += ["## Session-atomic bound (default policy, u = 0.5)\n",
              "The best imbalance a placement can reach without splitting a session, from the default policy's "
              "per-session computed tokens (module docstring). Report traces are listed to explain the report's "
              "figures; nothing here was chosen on them.\n",
              "| trace | role | replicas | sessions | session share of work | largest session / mean replica "
              "| bound | default's imbalance |", "|---|---|---|---|---|---|---|---|"]
    for b in report["bounds"]:
        lines.append(f"| {b['trace']} | {b['role']} | {b['replicas']} | {b['sessions']} | {b['session_share']:.2f} "
                     f"| {b['largest_session_vs_mean']:.2f} | {b['session_atomic_bound']:.2f} "
                     f"| {b['imbalance_default']:.2f} |")
    over = [b for b in report["bounds"] if b["session_atomic_bound"] > TARGET]
    lines.append(f"\nBound above {TARGET}: " + (", ".join(f"{b['trace']} at {b['replicas']} ({b['session_atomic_bound']:.2f})"
                                                       for b in over) or "none") + ".\n")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["summary"]), figsize=(5.2 * len(report["summary"]), 4.0), squeeze=False)
    for ax, (n, s) in zip(axes.flat, report["summary"].items()):
        for group, marker in (("hard", "o"), ("free", "s")):
            pts = [(d["imbalance_max"], d["goodput_vs_sglang_unicache"], v) for v, d in s.items() if v.startswith(group)]
            base = s[BASE]
            pts.append((base["imbalance_max"], base["goodput_vs_sglang_unicache"], "off"))
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{group} balance rule")
            for x, y, v in pts:
                ax.annotate(v.split(" ")[-1] if v != "off" else "off", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        sg = s[SGL_UC]
        ax.scatter([sg["imbalance_max"]], [1.0], color="black", marker="x", label="sglang+unicache")
        ax.axvline(TARGET, color="grey", linestyle="--", lw=1)
        ax.set_xlabel("max load imbalance at u = 0.5 (tuning traces)")
        ax.set_ylabel("goodput / sglang+unicache (geo mean)")
        ax.set_title(f"{n} replicas", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    run = parse_tuning_run(__doc__, argv)
    args, families, traces, common = run.args, run.families, run.traces, run.common
    configs = tuple((v, "cache_aware", "unicache") for v in VARIANTS) + (
        (SGL_UC, "sglang", "unicache"), (SGL_LRU, "sglang", "lru"))
    replicas = tuple(int(x) for x in args.replicas.split(","))
    jobs = [Job(t, replicas, configs, {v: kw for v, (_, kw) in VARIANTS.items()}, common,
                {v: cls for v, (cls, _) in VARIANTS.items()}) for t in traces]
    results = run_jobs(jobs, args.workers)
    # The report's traces for the bound (the report's own Mooncake slicing: slice 1 of 4).
    report_common = dict(common, mooncake_slices=4)
    bounds = [session_atomic_bound(t, n, common if t.role == "tune" else report_common)
              for t in [*traces, *[t for t in suite_traces(mooncake_slices=(1, 1), families=families)
                                   if t.role == "report"]]
              for n in replicas]
    report = {
        "command": "python -m bench.studies.routing_balance " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(),
        "traces": [t.name for t in traces],
        "variants": {v: {"class": cls.__name__, "kwargs": kw} for v, (cls, kw) in VARIANTS.items()},
        "summary": {str(n): summarise(results, str(n)) for n in replicas},
        "bounds": bounds, "results": results, "wall_s": time.perf_counter() - t0,
    }
    out_dir = Path(args.out_dir)
    write_report(out_dir, "routing_balance", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
