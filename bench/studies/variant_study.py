"""The shared harness of the routing studies that compare ``cache_aware`` variants on the
suite's tuning traces (``bench.studies.session_admission``, ``queue_share``,
``kv_admission``): replay each variant and sglang + unicache through the routing
report's machinery (``bench.routing_report.run_jobs``), summarise every variant against
the study's reference variant, write ``<stem>.{json,md}``.

Not a study itself: it has no ``main``.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, write_report
from bench.routing_report import GOODPUT_FLOOR_U, Job, cross_validate, run_jobs
from bench.studies.routing_admission import parse_tuning_run
from unicache.sim.replay import Replay
from unicache.sim.suite import FAMILIES

SGL_UC = "sglang+unicache"


def _lg(row: dict) -> float:
    return math.log(max(row["goodput_u"], GOODPUT_FLOOR_U))


def _geo(rows: list[dict], a: str, b: str) -> float:
    return math.exp(statistics.mean(_lg(x[a]) - _lg(x[b]) for x in rows))


BOOTSTRAP_DRAWS = 2000


def bootstrap_ci95(log_ratios: Sequence[float], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval of the geometric mean of paired ratios, resampling the
    traces with replacement (``log_ratios``: one log ratio per trace; seeded, so a rerun
    gives the same interval)."""
    rng = random.Random(seed)
    k = len(log_ratios)
    means = sorted(math.fsum(rng.choices(log_ratios, k=k)) / k for _ in range(draws))
    return math.exp(means[int(0.025 * draws)]), math.exp(means[int(0.975 * draws) - 1])


def summarise(results: list[dict], n: str, variants: Sequence[str], default: str) -> dict:
    """Per variant: goodput against ``default`` (with ``bootstrap_ci95``'s interval) and
    sglang + unicache (geometric means of paired per-trace ratios), token-hit points
    against ``default``, traces above / below it; overall and per family (``n`` replicas)."""
    fams = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    out = {}
    for v in variants:
        def agg(rs: list[dict]) -> dict:
            rows = [r["by_replicas"][n]["rows"] for r in rs]
            return {"vs_default": _geo(rows, v, default),
                    "vs_default_ci95": bootstrap_ci95([_lg(x[v]) - _lg(x[default]) for x in rows]),
                    "vs_sglang_unicache": _geo(rows, v, SGL_UC),
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
             "of paired per-trace ratios (95% interval: the traces resampled, ``bootstrap_ci95``); hit points at u = 0.5.\n"]
    for n, s in report["summary"].items():
        fams = list(next(iter(s.values()))["families"])
        lines += [f"## {n} replicas\n",
                  "| variant | goodput / default | 95% interval | / sglang+unicache | traces above / below default | hit pts vs default | "
                  + " | ".join(f"{f} / default" for f in fams) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(fams)]
        for v, d in s.items():
            a = d["all"]
            lo, hi = a["vs_default_ci95"]
            lines.append(f"| {v} | {a['vs_default']:.3f} | {lo:.3f}-{hi:.3f} | {a['vs_sglang_unicache']:.3f} | "
                         f"{a['traces_above_default']} / {a['traces_below_default']} | {a['hit_pts_vs_default']:+.2f} | "
                         + " | ".join(f"{d['families'][f]['vs_default']:.3f}" for f in fams) + " |")
        ref = report["default"]
        lines += [f"{ref} / sglang+unicache by family: "
                  + ", ".join(f"{f} {s[ref]['families'][f]['vs_sglang_unicache']:.3f}" for f in fams) + ".", ""]
        picks = report.get("held_out_picks", {}).get(n)
        if picks:
            lines.append("Leave one family out (best mean log goodput on the other families' traces): "
                         + ", ".join(f"{f} -> **{p['pick']}**" for f, p in picks.items()) + ".\n")
        overall = report.get("overall_picks", {}).get(n)
        if overall:
            lines.append(f"All families: pick **{overall['pick']}** (mean log goodput: "
                         + ", ".join(f"{v} {sc:.3f}" for v, sc in overall["scores"].items()) + ").\n")
    return "\n".join(lines) + "\n"


def run_variants(module: str, doc: str, argv: list[str] | None, variants: dict, default: str, stem: str, title: str,
                 replays: dict | None = None, common_extra: dict | None = None, held_out: bool = False,
                 defaults: dict | None = None, selectable: bool = False) -> int:
    """Replay ``variants`` (label -> (router class, kwargs)) and sglang + unicache on the
    tuning traces, then write ``<stem>.{json,md}``: the shared main of these studies.
    ``replays``: label -> a ``Replay`` subclass (sglang + unicache's label too);
    ``common_extra``: more of every job's replay settings (``bench.routing_report.run_job``'s
    ``args``); ``held_out``: add each family's leave-one-family-out pick and the all-family
    pick at each replica count (``bench.routing_report.cross_validate``'s, over the variants); ``defaults``: the
    study's own option defaults; ``selectable``: ``--variants a,b`` runs those and
    ``default`` only (``parse_tuning_run``)."""
    t0 = time.perf_counter()
    run = parse_tuning_run(doc, argv, defaults, [v for v in variants if v != default] if selectable else None)
    if selectable and run.args.variants is not None:
        variants = {v: variants[v] for v in (default, *run.args.variants)}
    args, traces, common = run.args, run.traces, {**run.common, **(common_extra or {})}
    configs = tuple((v, "cache_aware", "unicache") for v in variants) + ((SGL_UC, "sglang", "unicache"),)
    replicas = tuple(int(x) for x in args.replicas.split(","))
    kwargs = {v: kw for v, (_, kw) in variants.items()}
    factories = {v: cls for v, (cls, _) in variants.items()}
    jobs = [Job(t, replicas, configs, kwargs, common, factories, replays or {}) for t in traces]
    results = run_jobs(jobs, args.workers)
    cvs = {str(n): cross_validate(results, variants, str(n)) for n in replicas} if held_out else {}
    report = {
        "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(), "traces": [t.name for t in traces],
        "default": default,
        "variants": {v: {"class": cls.__name__, "kwargs": kw, "replay": (replays or {}).get(v, Replay).__name__}
                     for v, (cls, kw) in variants.items()},
        "summary": {str(n): summarise(results, str(n), list(variants), default) for n in replicas},
        **({"held_out_picks": {n: cv["lofo"] for n, cv in cvs.items()},
            "overall_picks": {n: {"pick": cv["overall_pick"], "scores": cv["overall_scores"]} for n, cv in cvs.items()}}
           if held_out else {}),
        "results": results, "wall_s": time.perf_counter() - t0,
    }
    write_report(Path(args.out_dir), stem, report, markdown(report, title))
    return 0
