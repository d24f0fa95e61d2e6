"""Routing over the workload suite: goodput and TTFT per family, defaults by cross-validation.

The suite (``unicache.sim.suite``): six families of generated mixes (every generator knob
drawn from wide ranges; several points per family, several seeds per point) and time
slices of the Mooncake conversation trace. Tuning traces (other points, other seeds, an
earlier Mooncake slice) are disjoint from the report traces.

Per trace and replica count (4 and 8):
    * capacity per replica = max(``--capacity-frac`` of the trace's unique blocks, twice
      its largest request);
    * load is put on a common footing: ``u = 1`` is the rate scale at which the tighter of
      prefill lanes and KV blocks pinned by running requests is nominally full
      (``nominal_scale``); goodput is reported in these units (``goodput_u``, the rate
      scale divided by the trace's ``u = 1`` scale), and TTFT, token hits and imbalance are
      compared at ``u = --u-ref`` (0.5);
    * goodput: the highest u whose TTFT p90 is within the SLO (default 3 x the unloaded
      TTFT of the trace's median request; on Mooncake, whose p90 request alone takes
      longer than that, 3 x the unloaded TTFT of its p90 request), bracketed by doubling or halving u from 0.5
      (range 1/16 to 8), narrowed by ``BISECT_STEPS`` (3) bisections in log u (the bracket
      becomes a factor 2^(1/8), 9%, wide), then interpolated in log u between the highest
      pass below the first failure and that failure (``unicache.sim.goodput``). p90 is
      not monotone in u (a higher load can place requests better), so goodput is where
      p90 *first* crosses the SLO among the scales replayed.

Cross-validation: each candidate setting of ``cache_aware`` (``CANDIDATES``) is scored on
the tuning traces by the mean of log goodput_u (4 replicas; goodput floored at 1/32). For
every family, the candidate with the best score on the *other* families' tuning traces
(leave one family out) is what that family is reported with; the all-family pick is the
shipped default (the report says whether the code's defaults equal it).

Targets per family at 4 and 8 replicas (cache_aware + unicache, the family's held-out
pick): goodput >= 1.3 x sglang + lru and >= 1.1 x sglang + unicache (geometric mean of
per-trace ratios); TTFT p90 and p99 <= both (family mean at u_ref); token hit >= sglang +
unicache - 0.5 points (family mean at u_ref); load imbalance <= 1.2 (family max at u_ref).

Run (from the repository root, niced, 2 worker processes):
    nice -n 10 .venv/bin/python -m bench.routing_report [--workers 2] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from unicache.router.routing.cache_aware.policy import CacheAwareConfig
from unicache.sim.goodput import default_slo_s, goodput, lanes_unloaded_ttft_s
from unicache.sim.metrics import percentile
from unicache.sim.prepare import PreparedTrace
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.suite import FAMILIES, MOONCAKE, SuiteTrace, load_suite_trace, offered_prefill_s_per_s, suite_traces
from unicache.sim.timing import TimingModel
from bench.paths import REPO, RESULTS, mooncake_trace
from bench.report_files import git_commit, save_figure, write_report
from bench.workers import map_in_workers

OURS = ("cache_aware", "unicache")
BASELINES = (("sglang", "unicache"), ("sglang", "lru"))
# The reference no router reaches: one replica with every replica's blocks and prefill
# lanes (no placement loss, no cache duplicated, no lane idle while another has a queue),
# under the same eviction. Not a proof of a bound (unicache is not an optimal eviction, and
# a bigger shared cache can evict differently), but what a router's target is measured
# against: a goodput target above pooled/baseline is out of any router's reach there.
POOLED = "pooled"
POOLED_LABEL = "pooled+unicache"
# Candidate settings of cache_aware chosen among by cross-validation (kwargs over the
# constructor defaults): how far a replica's estimated TTFT may exceed the best one's and
# stay admissible, whether the session-footprint term (which trades locality for spreading
# new work) earns its place, and whether the cost counts a replica's queue over its prefill
# lanes (queue_per_lane). The churn term, fit-first and the queue share are fixed on: the
# cross-validation over 48 settings with each of them on and off (7 tuning traces) picked
# each for 7 of 7, 6 of 7 and 7 of 7 held-out families with the simulator's published queue
# as it is now. TTFT admission itself, against the fixed balance ratio it replaced, is
# the routing_admission study's (docs/studies.md) question.
def candidates(load_weights: Sequence[float] = (1.0,)) -> dict[str, dict]:
    """The cross-validation's settings: every admission factor x footprint weight x queue
    per lane at the default load weight (1.0), and with the queue per lane (every held-out
    family's pick) at each other load weight in ``load_weights`` (named ``...-lw<w>``;
    the ``capacity_terms`` study, docs/studies.md found 0.5 a lead)."""
    out: dict[str, dict] = {}
    for lw in load_weights:
        for af in (1.5, 2.0, 3.0):
            for fp in (0.5, 0.0):
                for ql in (True, False):
                    if lw != 1.0 and not ql:
                        continue
                    kw = {"admission_factor": af, "churn_weight": 0.5, "footprint_weight": fp,
                          "fit_first": True, "queue_share": True, "queue_per_lane": ql}
                    if lw != 1.0:
                        kw["load_weight"] = lw
                    out[f"af{af}-fp{fp}-ql{int(ql)}" + (f"-lw{lw:g}" if lw != 1.0 else "")] = kw
    return out


CANDIDATES: dict[str, dict] = candidates()
U_START, U_MIN, U_MAX = 0.5, 1.0 / 16, 8.0
BISECT_STEPS = 3  # geometric bisections of the doubling bracket (see the module docstring)
GOODPUT_FLOOR_U = 1.0 / 32
LANES = 4


# ------------------------------------------------------------------ one trace's replays
@dataclass(slots=True)
class Job:
    """Every replay of one trace (run in one worker, which prepares the trace once)."""

    trace: SuiteTrace
    replicas: tuple[int, ...]
    configs: tuple[tuple[str, str, str], ...]  # (label, router, eviction)
    kwargs: dict[str, dict] = field(default_factory=dict)  # label -> router kwargs
    args: dict = field(default_factory=dict)
    factories: dict[str, Callable] = field(default_factory=dict)  # label -> a study's router class
    replays: dict[str, type[Replay]] = field(default_factory=dict)  # label -> a study's Replay subclass
    # a study's own traces: (trace, args) -> PreparedTrace, instead of the suite's (a
    # module-level function: jobs are pickled to the workers)
    loader: Callable[[SuiteTrace, dict], PreparedTrace] | None = None


def capacity_floor_blocks(trace: PreparedTrace) -> int:
    """The least capacity a replica gets: twice the trace's largest request, in blocks."""
    return 2 * max(-(-r.num_tokens // trace.block_size) for r in trace.requests)


def capacity_of(unique_blocks: int, floor_blocks: int, frac: float) -> int:
    """Each replica's KV blocks: ``frac`` of the trace's unique blocks, at least the floor
    (``capacity_floor_blocks``; on small traces the floor is what decides)."""
    return max(int(frac * unique_blocks), floor_blocks)


def capacity_blocks(trace: PreparedTrace, frac: float) -> int:
    """``capacity_of`` a prepared trace."""
    return capacity_of(trace.unique_blocks, capacity_floor_blocks(trace), frac)


def nominal_scale(trace: PreparedTrace, cap: int, replicas: int, timing: TimingModel, lanes: int = LANES) -> float:
    """The rate scale at which the tighter resource is nominally full: prefill lanes
    (uncached, unbatched prefill seconds per second) or KV blocks held by decoding requests
    (block-seconds per second over every replica's capacity)."""
    reqs = trace.requests
    span = max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9)
    pinned = sum(-(-r.num_tokens // trace.block_size) * timing.decode_s(r.output_length) for r in reqs) / span
    prefill = offered_prefill_s_per_s(trace, timing)
    return 1.0 / max(pinned / (cap * replicas), prefill / (lanes * replicas))


def _slim(rec: dict, u: float) -> dict:
    keep = ("token_hit_ratio", "load_imbalance", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "rejected",
            "rate_scale")
    out = {k: rec[k] for k in keep if k in rec}
    out["u"] = u
    return out


def search_goodput(run_at, slo_s: float) -> tuple[float, bool, dict[float, dict]]:
    """Goodput in u (see the module docstring) and every replay made on the way."""
    seen: dict[float, dict] = {}

    def p90(u: float) -> float:
        if u not in seen:
            seen[u] = run_at(u)
        return seen[u]["ttft_p90_s"]

    u = U_START
    if p90(u) <= slo_s:
        while u < U_MAX:  # up to the first failure, U_MAX included
            u *= 2
            if not p90(u) <= slo_s:
                break
    else:
        while u > U_MIN:  # down to the first pass, U_MIN included
            u /= 2
            if p90(u) <= slo_s:
                break
    for _ in range(BISECT_STEPS):
        g = goodput(((k, v["ttft_p90_s"]) for k, v in seen.items()), slo_s)
        if g.saturated or g.rate_scale == 0.0:
            break  # nothing to narrow: every scale passed, or the lowest failed
        lo = max(k for k, v in seen.items() if k <= g.rate_scale and v["ttft_p90_s"] <= slo_s)
        hi = min(k for k in seen if k > lo)
        p90(math.sqrt(lo * hi))
    g = goodput(((k, v["ttft_p90_s"]) for k, v in seen.items()), slo_s)
    return g.rate_scale, g.saturated, seen


def run_job(job: Job) -> dict:
    """Search goodput for every (replicas, config) of one trace; metrics at u_ref."""
    a = job.args
    timing = TimingModel()
    t0 = time.process_time()
    if job.loader is not None:
        trace = job.loader(job.trace, a)
    else:
        trace = load_suite_trace(job.trace, mooncake_path=a["mooncake"], mooncake_slices=a["mooncake_slices"],
                                 duration=a["duration"], requests_per_s=a["requests_per_s"])
    floor = capacity_floor_blocks(trace)
    cap = capacity_of(trace.unique_blocks, floor, a["capacity_frac"])
    # a request alone on an idle replica with nothing cached (a study's service model may
    # bring its own: ``args["unloaded_ttft_s"]``, (timing, input length) -> seconds)
    unloaded_of = a.get("unloaded_ttft_s") or lanes_unloaded_ttft_s
    unloaded = [unloaded_of(timing, r.input_length) for r in trace.requests]
    slo = default_slo_s(trace, timing, unloaded_ttft=unloaded_of)
    slo_rule = "3 x unloaded median request"
    if job.trace.family == MOONCAKE or (a.get("slo_p90_fallback") and percentile(unloaded, 90.0) > slo):
        # NOTE: the median rule is below Mooncake's unloaded p90 (no router can meet it);
        # the p90 request's unloaded TTFT is the base there instead (a study may ask for
        # that wherever the median rule is out of reach: ``args["slo_p90_fallback"]``).
        slo, slo_rule = 3.0 * percentile(unloaded, 90.0), "3 x unloaded p90 request"
    out = {"trace": job.trace.name, "family": job.trace.family, "role": job.trace.role,
           "requests": len(trace.requests), "unique_blocks": trace.unique_blocks, "capacity_blocks": cap,
           "capacity_floor_blocks": floor,
           "slo_s": slo, "slo_rule": slo_rule, "default_slo_s": default_slo_s(trace, timing),
           "unloaded_ttft_p50_s": percentile(unloaded, 50.0), "unloaded_ttft_p90_s": percentile(unloaded, 90.0),
           "by_replicas": {}}
    for n in job.replicas:
        s1 = nominal_scale(trace, cap, n, timing)
        rows = {}
        for label, router, policy in job.configs:
            kwargs = job.kwargs.get(label, {})
            factory = job.factories.get(label)
            replay = job.replays.get(label, Replay)

            def run_at(u: float, router=router, policy=policy, kwargs=kwargs, factory=factory, replay=replay) -> dict:
                if router == POOLED:
                    cfg = ReplayConfig(policy, cap, replicas=n, pooled=True, lanes=LANES, rate_scale=u * s1)
                else:
                    cfg = ReplayConfig(policy, cap, replicas=n, router=router, lanes=LANES, rate_scale=u * s1,
                                       router_kwargs=kwargs, router_factory=factory)
                return _slim(replay(trace, cfg).run(), u)

            g, saturated, seen = search_goodput(run_at, slo)
            ref = seen.get(a["u_ref"]) or run_at(a["u_ref"])
            rows[label] = {"goodput_u": g, "goodput_saturated": saturated, "at_u_ref": ref,
                           "points": [seen[u] for u in sorted(seen)]}
        out["by_replicas"][str(n)] = {"nominal_scale": s1, "rows": rows}
    out["cpu_s"] = time.process_time() - t0
    print(f"  {job.trace.name}: {len(trace.requests)} requests, {out['cpu_s']:.0f} CPU s", file=sys.stderr, flush=True)
    return out


def run_jobs(jobs: list[Job], workers: int) -> list[dict]:
    return map_in_workers(run_job, jobs, workers)


def add_suite_args(ap: argparse.ArgumentParser) -> None:
    """The options of every replay of the suite (this report's and the routing studies'):
    the Mooncake trace, replica counts, worker processes, families, output folder."""
    ap.add_argument("--trace", default=str(mooncake_trace()), help="the Mooncake conversation trace")
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (at most 2 on the shared machine)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out-dir", default=str(RESULTS))


def parse_suite_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= 2:
        ap.error("--workers must be 1 or 2")
    return args


def report_suite(args: argparse.Namespace, **extra) -> tuple[dict, list[SuiteTrace]]:
    """This report's replay settings (its defaults, plus ``extra``) and its report traces
    for ``args.families``: what a study that replays the report's traces runs."""
    common = {"mooncake": args.trace, "mooncake_slices": 4, "duration": 300.0, "requests_per_s": 1.5,
              "capacity_frac": 0.02, "u_ref": 0.5, **extra}
    families = [f for f in args.families.split(",") if f]
    return common, [t for t in suite_traces(mooncake_slices=(1, 1), families=families) if t.role == "report"]


# ------------------------------------------------------------------ cross-validation
def _score(results: list[dict], label: str, n: str = "4") -> float:
    vals = [math.log(max(r["by_replicas"][n]["rows"][label]["goodput_u"], GOODPUT_FLOOR_U)) for r in results]
    return statistics.mean(vals)


def cross_validate(tune: list[dict], cands: Iterable[str] = CANDIDATES, n: str = "4") -> dict:
    """Per family: each candidate's score (mean log goodput at ``n`` replicas) on every
    other family's tuning traces, the held-out pick; and the all-family pick (ties: the
    earlier candidate)."""
    fams = sorted({r["family"] for r in tune}, key=FAMILIES.index)
    order = list(cands)
    per_family = {f: {c: _score([r for r in tune if r["family"] == f], c, n) for c in order} for f in fams}
    lofo = {}
    for f in fams:
        others = [r for r in tune if r["family"] != f]
        scores = {c: _score(others, c, n) for c in order}
        lofo[f] = {"pick": max(scores, key=lambda c: (scores[c], -order.index(c))), "scores": scores}
    overall = {c: _score(tune, c, n) for c in order}
    pick = max(overall, key=lambda c: (overall[c], -order.index(c)))
    return {"per_family_scores": per_family, "lofo": lofo, "overall_scores": overall, "overall_pick": pick}


def code_default_candidate(cands: dict[str, dict] = CANDIDATES) -> str | None:
    """The candidate whose kwargs equal ``CacheAwareConfig``'s defaults, if any."""
    defaults = {f.name: f.default for f in fields(CacheAwareConfig)}
    for name, kw in cands.items():
        if all(defaults[k] == v for k, v in kw.items()):
            return name
    return None


# ------------------------------------------------------------------ targets and tables
def _geo_ratio(a: list[float], b: list[float]) -> float:
    logs = []
    for x, y in zip(a, b):
        if y <= 0:
            if x <= 0:
                continue  # neither reaches the SLO on this trace: no ratio
            return math.inf
        logs.append(math.log(max(x, 1e-12) / y))
    return math.exp(statistics.mean(logs)) if logs else math.nan


def family_summary(results: list[dict], ours_label: str, n: str) -> dict:
    """Means over the family's report traces of every config, and the targets."""
    labels = [ours_label, "sglang+unicache", "sglang+lru", POOLED_LABEL]
    agg: dict[str, dict] = {}
    for label in labels:
        rows = [r["by_replicas"][n]["rows"][label] for r in results]
        ref = [row["at_u_ref"] for row in rows]
        agg[label] = {
            "goodput_u": [row["goodput_u"] for row in rows],
            "goodput_u_geomean": math.exp(statistics.mean(math.log(max(row["goodput_u"], GOODPUT_FLOOR_U))
                                                          for row in rows)),
            "token_hit_ratio": statistics.mean(x["token_hit_ratio"] for x in ref),
            "ttft_mean_s": statistics.mean(x["ttft_mean_s"] for x in ref),
            "ttft_p50_s": statistics.mean(x["ttft_p50_s"] for x in ref),
            "ttft_p90_s": statistics.mean(x["ttft_p90_s"] for x in ref),
            "ttft_p99_s": statistics.mean(x["ttft_p99_s"] for x in ref),
            "load_imbalance_max": max(x["load_imbalance"] for x in ref),
        }
    o, su, sl, p = agg[ours_label], agg["sglang+unicache"], agg["sglang+lru"], agg[POOLED_LABEL]
    g_lru = _geo_ratio(o["goodput_u"], sl["goodput_u"])
    g_uc = _geo_ratio(o["goodput_u"], su["goodput_u"])
    checks = {
        "goodput_vs_sglang_lru": {"value": g_lru, "target": ">= 1.3", "ok": g_lru >= 1.3},
        "goodput_vs_sglang_unicache": {"value": g_uc, "target": ">= 1.1", "ok": g_uc >= 1.1},
        "ttft_p90_le_both": {"value": o["ttft_p90_s"], "target": f"<= {min(su['ttft_p90_s'], sl['ttft_p90_s']):.4f}",
                             "ok": o["ttft_p90_s"] <= min(su["ttft_p90_s"], sl["ttft_p90_s"])},
        "ttft_p99_le_both": {"value": o["ttft_p99_s"], "target": f"<= {min(su['ttft_p99_s'], sl['ttft_p99_s']):.4f}",
                             "ok": o["ttft_p99_s"] <= min(su["ttft_p99_s"], sl["ttft_p99_s"])},
        "token_hit_vs_sglang_unicache": {"value": 100 * (o["token_hit_ratio"] - su["token_hit_ratio"]),
                                         "target": ">= -0.5 points",
                                         "ok": o["token_hit_ratio"] >= su["token_hit_ratio"] - 0.005},
        "load_imbalance": {"value": o["load_imbalance_max"], "target": "<= 1.2", "ok": o["load_imbalance_max"] <= 1.2},
    }
    pooled = {
        "goodput_vs_sglang_lru": _geo_ratio(p["goodput_u"], sl["goodput_u"]),
        "goodput_vs_sglang_unicache": _geo_ratio(p["goodput_u"], su["goodput_u"]),
        "ours_goodput_vs_pooled": _geo_ratio(o["goodput_u"], p["goodput_u"]),
        "traces_ours_above_pooled": sum(x > y for x, y in zip(o["goodput_u"], p["goodput_u"])),
        "token_hit_pts_vs_sglang_unicache": 100 * (p["token_hit_ratio"] - su["token_hit_ratio"]),
    }
    return {"configs": agg, "checks": checks, "pooled": pooled}


def target_table(families: dict[str, dict[str, dict]], traces: bool = False) -> tuple[list[str], int, int]:
    """The markdown table of ``family_summary`` results, ``families[family][replicas]``
    (``traces``: a column of each family's trace count, ``"traces"`` in its summary), and
    the checks met and made."""
    lines = ["| family | " + ("traces | " if traces else "") + "replicas | goodput / sglang+lru | goodput / "
             "sglang+unicache | TTFT p90 s ours / best sglang | p99 s ours / best sglang | token hit pts vs "
             "sglang+unicache | imbalance | of pooled's goodput | targets met |",
             "|---|" + ("---|" if traces else "") + "---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    for f, by_n in families.items():
        for n, s in by_n.items():
            c, cfg = s["checks"], s["configs"]
            su, sl = cfg["sglang+unicache"], cfg["sglang+lru"]
            ok = sum(v["ok"] for v in c.values())
            met, total = met + ok, total + len(c)
            lines.append(
                f"| {f} | " + (f"{s['traces']} | " if traces else "") + f"{n} | "
                f"{c['goodput_vs_sglang_lru']['value']:.3f} | {c['goodput_vs_sglang_unicache']['value']:.3f} | "
                f"{c['ttft_p90_le_both']['value']:.3f} / {min(su['ttft_p90_s'], sl['ttft_p90_s']):.3f} | "
                f"{c['ttft_p99_le_both']['value']:.3f} / {min(su['ttft_p99_s'], sl['ttft_p99_s']):.3f} | "
                f"{c['token_hit_vs_sglang_unicache']['value']:+.2f} | {c['load_imbalance']['value']:.2f} | "
                f"{s['pooled']['ours_goodput_vs_pooled']:.3f} | {ok}/{len(c)} |")
    return lines, met, total


def _fmt(v: float) -> str:
    return "inf" if v == math.inf else ("n/a" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}")


def markdown(report: dict) -> str:
    cv = report["cross_validation"]
    cands = list(report["candidates"])
    lines = [
        "# Routing report: the workload suite\n",
        f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs, {report['workers']} workers) "
        f"at commit {report['commit']}; {report['wall_s'] / 60:.1f} min wall, {report['cpu_s'] / 60:.1f} CPU min.\n",
        f"{report['traces']['report']} report traces and {report['traces']['tune']} tuning traces "
        f"({report['suite']}). Capacity per replica: max({report['capacity_frac']:.0%} of unique blocks, 2 x the "
        f"largest request). Load in u (1 = the tighter of prefill lanes and KV blocks nominally full); TTFT, token hit "
        f"and imbalance at u = {report['u_ref']}; goodput = highest u with TTFT p90 <= 3 x the unloaded TTFT of the "
        "trace's median request.\n",
        "## Cross-validation (leave one family out)\n",
        "Score = mean log goodput_u over tuning traces at 4 replicas. Pick = best on the other families.\n",
        "| held-out family | pick | " + " | ".join(cands) + " |",
        "|---|---|" + "---|" * len(cands),
    ]
    for f, v in cv["lofo"].items():
        lines.append(f"| {f} | {v['pick']} | " + " | ".join(f"{v['scores'][c]:.3f}" for c in cands) + " |")
    lines.append(f"\nAll tuning families: pick **{cv['overall_pick']}** (" + ", ".join(
        f"{c} {s:.3f}" for c, s in cv["overall_scores"].items()) + f"). Code defaults: {report['code_default']}"
        + (" (equal to the all-family pick)." if report["code_default"] == cv["overall_pick"]
           else " (NOT the all-family pick).") + "\n")
    lines.append("Per-family tuning scores (each candidate on that family's own tuning traces):\n")
    lines.append("| family | " + " | ".join(cands) + " |")
    lines.append("|---|" + "---|" * len(cands))
    for f, sc in cv["per_family_scores"].items():
        lines.append(f"| {f} | " + " | ".join(f"{sc[c]:.3f}" for c in cands) + " |")
    lines.append("")
    lines.append("## Summary across families (cache_aware + unicache with its held-out pick)\n")
    lines.append("| family | replicas | goodput / sglang+lru | goodput / sglang+unicache | p90 s (ours / best sglang) "
                 "| p99 s (ours / best sglang) | token hit pts vs sglang+unicache | imbalance | targets met |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for f, by_n in report["families"].items():
        for n, fam in by_n.items():
            c, cfg = fam["checks"], fam["configs"]
            ours = cfg[fam["ours_label"]]
            best90 = min(cfg["sglang+unicache"]["ttft_p90_s"], cfg["sglang+lru"]["ttft_p90_s"])
            best99 = min(cfg["sglang+unicache"]["ttft_p99_s"], cfg["sglang+lru"]["ttft_p99_s"])
            met = sum(v["ok"] for v in c.values())
            lines.append(
                f"| {f} | {n} | {_fmt(c['goodput_vs_sglang_lru']['value'])} | {_fmt(c['goodput_vs_sglang_unicache']['value'])} "
                f"| {ours['ttft_p90_s']:.3f} / {best90:.3f} | {ours['ttft_p99_s']:.3f} / {best99:.3f} "
                f"| {c['token_hit_vs_sglang_unicache']['value']:+.2f} | {c['load_imbalance']['value']:.3f} | {met}/{len(c)} |")
    lines.append("")
    lines.append("Targets held on every family and replica count: " + ", ".join(
        f"{k} {'yes' if v else 'NO'}" for k, v in report["targets_everywhere"].items()) + ".\n")
    lines.append(f"Worst family (most targets missed, then lowest goodput ratio vs sglang+unicache): "
                 f"**{report['worst_family']}**.\n")
    lines.append("## Reference: the pooled replica\n")
    lines.append(f"`{POOLED_LABEL}`: one replica holding every replica's blocks and prefill lanes, unicache "
                 "eviction, the same arrivals (no placement loss, nothing cached twice, no lane idle while "
                 "another has a queue). Not a proven bound, but where pooled / baseline is below a goodput "
                 "target, the target is out of a router's reach on that family.\n")
    lines.append("| family | replicas | pooled / sglang+lru | pooled / sglang+unicache | ours / pooled "
                 "| traces ours > pooled | pooled token hit pts vs sglang+unicache |")
    lines.append("|---|---|---|---|---|---|---|")
    for f, by_n in report["families"].items():
        for n, fam in by_n.items():
            p = fam["pooled"]
            lines.append(f"| {f} | {n} | {_fmt(p['goodput_vs_sglang_lru'])} | {_fmt(p['goodput_vs_sglang_unicache'])} "
                         f"| {_fmt(p['ours_goodput_vs_pooled'])} | {p['traces_ours_above_pooled']}/{fam['traces']} "
                         f"| {p['token_hit_pts_vs_sglang_unicache']:+.2f} |")
    lines.append("")
    lines.append("SLO per trace (unloaded TTFT = one request alone, nothing cached):\n")
    lines.append("| trace | requests | SLO rule | SLO s | 3 x unloaded median s | unloaded p90 s |")
    lines.append("|---|---|---|---|---|---|")
    for r in report["report_traces"]:
        lines.append(f"| {r['trace']} | {r['requests']} | {r['slo_rule']} | {r['slo_s']:.3f} | {r['default_slo_s']:.3f} "
                     f"| {r['unloaded_ttft_p90_s']:.3f} |")
    lines.append("")
    for f, by_n in report["families"].items():
        lines.append(f"## {f}\n")
        for n, fam in by_n.items():
            lines.append(f"### {n} replicas ({fam['traces']} traces)\n")
            lines.append("| router + eviction | goodput u (geo mean) | token hit % | imbalance (max) | TTFT mean s "
                         "| p50 s | p90 s | p99 s |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for label, v in fam["configs"].items():
                lines.append(f"| {label} | {v['goodput_u_geomean']:.3f} | {100 * v['token_hit_ratio']:.2f} "
                             f"| {v['load_imbalance_max']:.3f} | {v['ttft_mean_s']:.4f} | {v['ttft_p50_s']:.4f} "
                             f"| {v['ttft_p90_s']:.4f} | {v['ttft_p99_s']:.4f} |")
            lines.append("\nTargets: " + "; ".join(f"{k} {_fmt(v['value'])} ({v['target']}) "
                                                   f"{'met' if v['ok'] else 'NOT met'}" for k, v in fam["checks"].items())
                         + ".\n")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """TTFT p90 against u per router, one panel per family (first report trace, 4
    replicas), with the trace's SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(report["families"])
    cols = 4
    rows = -(-len(fams) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(fams):]:
        ax.axis("off")
    for ax, f in zip(axes.flat, fams):
        tr = next(r for r in report["report_traces"] if r["family"] == f)
        for label, row in tr["by_replicas"]["4"]["rows"].items():
            pts = sorted((p["u"], p["ttft_p90_s"]) for p in row["points"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(tr["slo_s"], color="grey", linestyle="--", label="SLO")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{tr['trace']} (4 replicas)", fontsize=9)
        ax.set_xlabel("load u")
        ax.set_ylabel("TTFT p90 s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, path)


def _worst(families: dict) -> str:
    def key(f: str):
        missed = sum(not v["ok"] for fam in families[f].values() for v in fam["checks"].values())
        ratio = min(fam["checks"]["goodput_vs_sglang_unicache"]["value"] for fam in families[f].values())
        return (-missed, ratio if not math.isnan(ratio) else -1.0)

    return min(families, key=key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(ap)
    ap.add_argument("--points", type=int, default=2, help="report points per generated family (default 2)")
    ap.add_argument("--seeds", type=int, default=2, help="report seeds per point (default 2)")
    ap.add_argument("--tune-points", type=int, default=4,
                    help="tuning points per generated family, one seed each (default 4)")
    ap.add_argument("--mooncake-slices", type=int, default=4, help="equal time slices of Mooncake (default 4)")
    ap.add_argument("--mooncake-report", type=int, default=1, help="Mooncake slices reported (after 1 tuning slice)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of generated arrivals (default 300)")
    ap.add_argument("--requests-per-s", type=float, default=1.5)
    ap.add_argument("--capacity-frac", type=float, default=0.02)
    ap.add_argument("--u-ref", type=float, default=0.5)
    ap.add_argument("--cv-only", action="store_true", help="run the cross-validation, print it and stop")
    ap.add_argument("--load-weights", default="1.0",
                    help="cache_aware load weights the cross-validation tries (default 1.0, the shipped one; "
                         "e.g. 1.0,0.5: candidates())")
    args = parse_suite_args(ap, argv)
    t0, cpu0 = time.perf_counter(), time.process_time()
    families = [f for f in args.families.split(",") if f]
    replicas = tuple(int(x) for x in args.replicas.split(","))
    common = {"mooncake": args.trace, "mooncake_slices": args.mooncake_slices, "duration": args.duration,
              "requests_per_s": args.requests_per_s, "capacity_frac": args.capacity_frac, "u_ref": args.u_ref}
    traces = suite_traces(points=args.points, seeds=args.seeds, tune_points=args.tune_points,
                          mooncake_slices=(1, args.mooncake_report), families=families)
    tune_t = [t for t in traces if t.role == "tune"]
    report_t = [t for t in traces if t.role == "report"]

    try:
        cands = candidates(tuple(float(w) for w in args.load_weights.split(",") if w))
    except ValueError:
        ap.error("--load-weights takes comma-separated numbers")
    print(f"cross-validation: {len(tune_t)} tuning traces x {len(cands)} candidates", file=sys.stderr)
    cand_cfgs = tuple((c, "cache_aware", "unicache") for c in cands)
    tune = run_jobs([Job(t, (4,), cand_cfgs, dict(cands), common) for t in tune_t], args.workers)
    cv = cross_validate(tune, cands)
    default = code_default_candidate(cands)
    if args.cv_only:
        print(json.dumps({"cv": cv, "code_default": default}, indent=1))
        return 0

    print(f"report: {len(report_t)} traces", file=sys.stderr)
    jobs = []
    for t in report_t:
        picks = {default or "default", cv["lofo"][t.family]["pick"]}
        cfgs = [("sglang+unicache", "sglang", "unicache"), ("sglang+lru", "sglang", "lru"),
                (POOLED_LABEL, POOLED, "unicache")]
        kwargs = {}
        for p in sorted(picks):
            label = f"cache_aware[{p}]+unicache"
            cfgs.insert(0, (label, "cache_aware", "unicache"))
            kwargs[label] = cands.get(p, {})
        jobs.append(Job(t, replicas, tuple(cfgs), kwargs, common))
    results = run_jobs(jobs, args.workers)

    fam_out: dict[str, dict] = {}
    for f in families:
        rs = [r for r in results if r["family"] == f]
        ours_label = f"cache_aware[{cv['lofo'][f]['pick']}]+unicache"
        fam_out[f] = {}
        for n in map(str, replicas):
            s = family_summary(rs, ours_label, n)
            default_label = f"cache_aware[{default or 'default'}]+unicache"
            if default_label != ours_label:
                s["configs"][default_label] = family_summary(rs, default_label, n)["configs"][default_label]
            s.update(ours_label=ours_label, traces=len(rs))
            fam_out[f][n] = s
    everywhere = {k: all(fam[n]["checks"][k]["ok"] for fam in fam_out.values() for n in fam)
                  for k in next(iter(next(iter(fam_out.values())).values()))["checks"]}
    report = {
        "command": "python -m bench.routing_report " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": platform.node() or "unknown", "cpus": os.cpu_count(), "workers": args.workers,
        "commit": git_commit(REPO), "python": platform.python_version(),
        "suite": f"{len([f for f in families if f != MOONCAKE])} generated families x {args.points} points x "
                 f"{args.seeds} seeds to report, {args.tune_points} other points x 1 other seed to tune, "
                 f"{args.duration:.0f} s each; Mooncake: slice 0 of {args.mooncake_slices} tunes, "
                 f"{args.mooncake_report} later slice(s) report",
        "traces": {"tune": len(tune_t), "report": len(report_t)},
        "capacity_frac": args.capacity_frac, "u_ref": args.u_ref, "replicas": list(replicas),
        "candidates": cands, "code_default": default, "cross_validation": cv,
        "families": fam_out, "targets_everywhere": everywhere, "worst_family": _worst(fam_out),
        "tune_traces": tune, "report_traces": results,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0 + sum(r["cpu_s"] for r in tune + results),
    }
    out_dir = Path(args.out_dir)
    write_report(out_dir, "routing_report", report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
