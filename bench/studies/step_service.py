"""Do issue 13's routing figures hold on a service model nobody tuned on?

Every routing default was chosen, and every report figure measured, on the simulator's
lanes model: a replica prefills batches on 4 independent lanes and decodes beside them for
free. vLLM runs one engine that steps through a shared token budget, decodes and prefill
chunks together (``unicache.sim.steps.StepReplay``: the same nominal capacity, another
discipline). This study replays the routing report's own report traces (the same suite,
the same capacity and goodput search) on the step model, with ``cache_aware``'s shipped
default (not a per-family pick: nothing here is chosen), sglang + unicache, sglang + lru
and the pooled replica, and scores the same six targets per family. The SLO is 3 x the
step model's TTFT of the median request (of the p90 one on Mooncake) under light load: on
a replica that is decoding, a new request first waits for the step in flight and its own
steps last at least a decode step (``unloaded_ttft_s(..., decoding=True)``), so every
router's p90 sits near 2 decode steps at any load; 3 x the idle TTFT (the report's rule on
the lanes model, where decodes never delay a prefill) would sit at that floor and make
goodput noise.

Writes ``step_service.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.step_service [--workers 2] [--replicas 4,8]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit, write_report
from bench.routing_report import (
    LANES, POOLED, POOLED_LABEL, Job, _worst, add_suite_args, family_summary, parse_suite_args, report_suite, run_jobs,
    target_table,
)
from unicache.sim.replay import Replay
from unicache.sim.steps import StepReplay, unloaded_ttft_s

OURS = "cache_aware+unicache"
CONFIGS = ((OURS, "cache_aware", "unicache"), ("sglang+unicache", "sglang", "unicache"),
           ("sglang+lru", "sglang", "lru"), (POOLED_LABEL, POOLED, "unicache"))


def markdown(report: dict) -> str:
    lines = [f"# {report['title']} (report traces, shipped default)\n",
             f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs, {report['workers']} "
             f"workers) at commit {report['commit']}; {report['wall_s'] / 60:.1f} min wall. "
             f"{report['traces']} report traces of the routing report's suite; {report['conditions']}\n"]
    table, met, total = target_table(report["families"])
    lines += [*table, "", f"Targets met: **{met} of {total}** checks. Worst family (most missed, then lowest goodput "
                  f"ratio vs sglang+unicache): **{report['worst_family']}**.", ""]
    return "\n".join(lines) + "\n"


def run_shipped_default(module: str, argv: list[str] | None, args: argparse.Namespace, stem: str, title: str,
                        conditions: str, replay: type[Replay] = Replay,
                        notes: Callable[[dict], str] | None = None, **settings) -> int:
    """Replay the routing report's report traces for ``args.families`` with ``cache_aware``'s
    shipped default, sglang + unicache, sglang + lru and pooled, every one on ``replay``,
    with the report's replay settings overridden by ``settings`` (``report_suite``), score
    the six targets per family and write ``<stem>.{json,md}`` (``conditions``: what the
    report states about the replays, after the trace count; ``notes``: report -> more
    markdown after the table)."""
    t0 = time.perf_counter()
    families = [f for f in args.families.split(",") if f]
    replicas = tuple(int(x) for x in args.replicas.split(","))
    common, traces = report_suite(args, **settings)
    replays = {label: replay for label, _, _ in CONFIGS}
    results = run_jobs([Job(t, replicas, CONFIGS, {}, common, {}, replays) for t in traces], args.workers)
    fam_out = {f: {str(n): family_summary([r for r in results if r["family"] == f], OURS, str(n)) for n in replicas}
               for f in families}
    report = {
        "title": title, "conditions": conditions,
        "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(), "traces": len(traces),
        "settings": {k: v for k, v in common.items() if isinstance(v, (int, float, str))},
        "families": fam_out, "worst_family": _worst(fam_out), "results": results,
        "wall_s": time.perf_counter() - t0,
    }
    write_report(Path(args.out_dir), stem, report, markdown(report) + (notes(report) if notes else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(ap)
    args = parse_suite_args(ap, argv)
    # the routing report's settings and report traces, the step model's light-load TTFT
    return run_shipped_default(
        "bench.studies.step_service", argv, args, "step_service", "Routing on the step service model",
        "every replay on `unicache.sim.steps.StepReplay`; SLO = 3 x the step model's TTFT under light load "
        "(module docstring).", replay=StepReplay,
        unloaded_ttft_s=functools.partial(unloaded_ttft_s, lanes=LANES, decoding=True))


if __name__ == "__main__":
    sys.exit(main())
