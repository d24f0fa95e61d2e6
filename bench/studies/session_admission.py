"""Should an explicit session leave a busy home sooner (or later) than other requests?

``cache_aware`` sends a session's next turn to its previous turn's replica unless that
replica is not *admissible*: its estimated TTFT (uncached prompt tokens + queued prefill
tokens / lanes) above ``admission_factor`` (2.0) x the best replica's
(``unicache.router.routing.admission``). The routing report's pooled reference puts the
agent family furthest from what one pooled replica reaches (0.65 of its goodput at 4
replicas) with every router hitting the same share of tokens there, so the distance is
queueing: turns of sessions kept home wait for one replica's lanes. This study gives the
home check its own factor (``SessionAdmissionPolicy``, this study's subclass, never
registered): below 2.0 a turn leaves a busy home sooner (its placement then goes to the
cost, which still weighs the home's cached prefix), above 2.0 later.

Tuning traces only (``bench.studies.routing_admission``'s: generated points 1000.. and
Mooncake slices 0-1 of 8; none is a report trace), 4 and 8 replicas, goodput and metrics
by the routing report's own machinery. Scores: geometric mean of per-trace goodput ratios
against the shipped default and against sglang + unicache, overall and per family.

Writes ``session_admission.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.session_admission [--points 4] [--workers 2]
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, write_report
from bench.routing_report import GOODPUT_FLOOR_U, Job, run_jobs
from unicache.sim.replay import Replay
from bench.studies.routing_admission import parse_tuning_run
from unicache.router.routing.admission import TTFTAdmission
from unicache.router.routing.base import ReplicaLoad
from unicache.router.routing.cache_aware import CacheAwarePolicy
from unicache.sim.suite import FAMILIES

DEFAULT = "default (home factor 2.0)"
SGL_UC = "sglang+unicache"


class SessionAdmissionPolicy(CacheAwarePolicy):
    """``cache_aware`` whose session-home check uses ``session_admission_factor`` instead
    of ``admission_factor`` (every other decision unchanged)."""

    def __init__(self, session_admission_factor: float = 1.5, **kwargs):
        super().__init__(**kwargs)
        self.session_admission = TTFTAdmission(session_admission_factor, self.admission.prefill_lanes)
        self._home_admissible: list[ReplicaLoad] = []

    def _admissible(self, replicas: Sequence[ReplicaLoad], n_tokens: int, block_size: int,
                    matches: dict[str, int]) -> list[ReplicaLoad]:
        self._home_admissible = self.session_admission.admissible(replicas, n_tokens, block_size, matches)
        return super()._admissible(replicas, n_tokens, block_size, matches)

    def _session_home(self, prev, hashes, admissible, index, matches):
        return super()._session_home(prev, hashes, self._home_admissible, index, matches)


VARIANTS: dict[str, tuple[type[CacheAwarePolicy], dict]] = {
    DEFAULT: (CacheAwarePolicy, {}),
    "home factor 1.25": (SessionAdmissionPolicy, {"session_admission_factor": 1.25}),
    "home factor 1.5": (SessionAdmissionPolicy, {"session_admission_factor": 1.5}),
    "home factor 3.0": (SessionAdmissionPolicy, {"session_admission_factor": 3.0}),
}


def _lg(row: dict) -> float:
    return math.log(max(row["goodput_u"], GOODPUT_FLOOR_U))


def _geo(rows: list[dict], a: str, b: str) -> float:
    return math.exp(statistics.mean(_lg(x[a]) - _lg(x[b]) for x in rows))


def summarise(results: list[dict], n: str, variants: Sequence[str], default: str) -> dict:
    """Per variant: goodput against ``default`` and sglang + unicache (geometric means of
    paired per-trace ratios), token-hit points against ``default``, traces above / below
    it; overall and per family (``n`` replicas)."""
    fams = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    out = {}
    for v in variants:
        def agg(rs: list[dict]) -> dict:
            rows = [r["by_replicas"][n]["rows"] for r in rs]
            return {"vs_default": _geo(rows, v, default), "vs_sglang_unicache": _geo(rows, v, SGL_UC),
                    "hit_pts_vs_default": 100 * statistics.mean(
                        x[v]["at_u_ref"]["token_hit_ratio"] - x[default]["at_u_ref"]["token_hit_ratio"] for x in rows),
                    "traces_above_default": sum(x[v]["goodput_u"] > x[default]["goodput_u"] for x in rows),
                    "traces_below_default": sum(x[v]["goodput_u"] < x[default]["goodput_u"] for x in rows),
                    "traces": len(rows)}
        out[v] = {"all": agg(results), "families": {f: agg([r for r in results if r["family"] == f]) for f in fams}}
    return out


def markdown(report: dict, title: str) -> str:
    """The report of a study of ``cache_aware`` variants on tuning traces (``summarise``'s tables)."""
    lines = [f"# {title} (tuning traces only)\n",
             f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs, {report['workers']} "
             f"workers) at commit {report['commit']}; {report['wall_s'] / 60:.1f} min wall.\n",
             f"Tuning traces ({len(report['traces'])}): {', '.join(report['traces'])}. Goodput ratios: geometric means "
             "of paired per-trace ratios; hit points at u = 0.5.\n"]
    for n, s in report["summary"].items():
        fams = list(next(iter(s.values()))["families"])
        lines += [f"## {n} replicas\n",
                  "| variant | goodput / default | / sglang+unicache | traces above / below default | hit pts vs default | "
                  + " | ".join(f"{f} / default" for f in fams) + " |",
                  "|---|---|---|---|---|" + "---|" * len(fams)]
        for v, d in s.items():
            a = d["all"]
            lines.append(f"| {v} | {a['vs_default']:.3f} | {a['vs_sglang_unicache']:.3f} | "
                         f"{a['traces_above_default']} / {a['traces_below_default']} | {a['hit_pts_vs_default']:+.2f} | "
                         + " | ".join(f"{d['families'][f]['vs_default']:.3f}" for f in fams) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def run_variants(module: str, doc: str, argv: list[str] | None, variants: dict, default: str, stem: str, title: str,
                 replays: dict | None = None) -> int:
    """Replay ``variants`` (label -> (router class, kwargs)) and sglang + unicache on the
    tuning traces, then write ``<stem>.{json,md}``: the shared main of these studies."""
    t0 = time.perf_counter()
    run = parse_tuning_run(doc, argv)
    args, traces, common = run.args, run.traces, run.common
    configs = tuple((v, "cache_aware", "unicache") for v in variants) + ((SGL_UC, "sglang", "unicache"),)
    replicas = tuple(int(x) for x in args.replicas.split(","))
    kwargs = {v: kw for v, (_, kw) in variants.items()}
    factories = {v: cls for v, (cls, _) in variants.items()}
    jobs = [Job(t, replicas, configs, kwargs, common, factories, replays or {}) for t in traces]
    results = run_jobs(jobs, args.workers)
    report = {
        "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(), "traces": [t.name for t in traces],
        "variants": {v: {"class": cls.__name__, "kwargs": kw, "replay": (replays or {}).get(v, Replay).__name__}
                     for v, (cls, kw) in variants.items()},
        "summary": {str(n): summarise(results, str(n), list(variants), default) for n in replicas},
        "results": results, "wall_s": time.perf_counter() - t0,
    }
    write_report(Path(args.out_dir), stem, report, markdown(report, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_variants("bench.studies.session_admission", __doc__, argv, VARIANTS, DEFAULT, "session_admission",
                        "A session's home: its own admission factor")


if __name__ == "__main__":
    sys.exit(main())
