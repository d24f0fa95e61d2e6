"""The live A/B's figures: runs folded into per-arm, per-rate fields, goodput, the
simulator's prediction beside them, the markdown table and the plot (bench/live_ab.py).

Field names are the issue's (36): ``arms: {name: {hit_ratio, ttft_p50_s, ttft_p90_s,
ttft_p99_s, goodput, router_cpu_ms_per_request, requests, failed, rates: [{rate_scale,
...}]}}``. Each rate's fields pool every round's requests; an arm's top-level fields are its
lowest rate's, except ``goodput``: the highest rate scale whose TTFT p90 stays within the
SLO with no failed request (0 when none does), over all rates.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.live_ab_stats import hit_ratio_ci, ttft_ci, verdict
from unicache.sim.metrics import percentile

RATE_FIELDS = ("hit_ratio", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "goodput",
               "router_cpu_ms_per_request", "requests", "failed", "hit_ratio_ci", "ttft_p50_ci_s", "ttft_p90_ci_s",
               "ttft_mean_s", "router_ttft_mean_s", "server_ttft_mean_s", "router_wait_ms_per_request",
               "router_overdue_share")
# (field, its interval, lower is better) of the figures compared arm against arm
COMPARED = (("hit_ratio", "hit_ratio_ci", False), ("ttft_p50_s", "ttft_p50_ci_s", True), ("ttft_p90_s", "ttft_p90_ci_s", True))


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def rate_fields(runs: list[dict], rate_scale: float, slo_s: float) -> dict:
    """One (arm, rate)'s fields from its runs (one per round). A run holds ``outcomes``,
    ``hits``, ``queries`` (prompt tokens, summed over the servers) and ``cpu_s``."""
    outcomes = [o for r in runs for o in r["outcomes"]]
    ok = [o for o in outcomes if o.error is None]
    ttft, e2e = [o.ttft_s for o in ok], [o.e2e_s for o in ok]
    queries = sum(r["queries"] for r in runs)
    p90 = _pct(ttft, 90)
    failed = len(outcomes) - len(ok)
    server_n = sum(r.get("server_ttft_count", 0.0) for r in runs)
    router_n = sum(r.get("router_ttft_count", 0.0) for r in runs)
    return {
        "rate_scale": rate_scale,
        "hit_ratio": sum(r["hits"] for r in runs) / queries if queries else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": p90, "ttft_p99_s": _pct(ttft, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p90_s": _pct(e2e, 90),
        # the mean TTFT at the client beside our router's own (from the request's
        # preparation; streamed requests only, as the replay's) and the servers' (vLLM's TTFT
        # histogram, from the request's arrival in vLLM): what lies between is the path's
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "router_ttft_mean_s": sum(r.get("router_ttft_sum_s", 0.0) for r in runs) / router_n if router_n else None,
        "server_ttft_mean_s": sum(r.get("server_ttft_sum_s", 0.0) for r in runs) / server_n if server_n else None,
        "goodput": rate_scale if p90 is not None and p90 <= slo_s and failed == 0 else 0.0,
        "router_cpu_ms_per_request": 1000.0 * sum(r["cpu_s"] for r in runs) / max(1, len(outcomes)),
        # the router's threads runnable without a core (the engines hold them) over the replay
        "router_wait_ms_per_request": (1000.0 * sum(r["runqueue_wait_s"] for r in runs) / max(1, len(outcomes))
                                       if all("runqueue_wait_s" in r for r in runs) else None),
        # our router: the share of its backends' time over the replays it priced them overdue
        # (router/request_path/cost_observer.py); None for a peer or a run that predates it
        "router_overdue_share": (sum(r["router_overdue_s"] for r in runs) / sum(r["replay_s"] * r["backends"] for r in runs)
                                 if all(r.get("router_overdue_s") is not None and r.get("replay_s") for r in runs) else None),
        "requests": len(outcomes), "failed": failed,
        "router_idle_cpu_pct": 100.0 * sum(r["idle_cpu"] for r in runs) / len(runs),
        "hit_ratio_rounds": [r["hits"] / r["queries"] if r["queries"] else 0.0 for r in runs],
        # bootstrap intervals over the requests of every round (bench/live_ab_stats.py)
        "hit_ratio_ci": hit_ratio_ci([(o.cached_tokens, o.prompt_tokens) for o in ok
                                      if o.cached_tokens is not None and o.prompt_tokens]),
        "ttft_p50_ci_s": ttft_ci(ttft, 50), "ttft_p90_ci_s": ttft_ci(ttft, 90),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def arm_fields(rates: list[dict]) -> dict:
    """An arm's fields: the lowest rate's, goodput over all rates, and ``rates``."""
    rates = sorted(rates, key=lambda r: r["rate_scale"])
    top = {k: rates[0][k] for k in RATE_FIELDS}
    top["goodput"] = max(r["goodput"] for r in rates)
    return {**top, "rates": rates}


def verdicts(arms: dict, ours: str = "ours") -> dict:
    """Per other arm and rate: ``ours``' verdict against it on each compared figure
    ("better", "worse", or "tie": the bootstrap intervals overlap)."""
    if ours not in arms:
        return {}
    mine = {r["rate_scale"]: r for r in arms[ours]["rates"]}
    out = {}
    for name, a in arms.items():
        if name == ours:
            continue
        out[name] = [{"rate_scale": r["rate_scale"], **{
            field: verdict(mine[r["rate_scale"]].get(ci), r.get(ci), lower) for field, ci, lower in COMPARED}}
            for r in a["rates"] if r["rate_scale"] in mine]
    return out


def _ci(v) -> str:
    return "-" if not v else f"[{v[0]:.3f}, {v[1]:.3f}]"


def _ci_ms(v) -> str:
    return "-" if not v else f"[{v[0] * 1000:.0f}, {v[1] * 1000:.0f}]"


def sim_prediction(sim: dict, arms: dict, arm_sims: dict[str, tuple[str, str]]) -> dict:
    """arm -> [{rate_scale, hit_ratio, ttft_p90_s}] from ``unicache sim --json``'s results
    (token hit ratio: vLLM's counters count prompt tokens), plus the sim's goodput."""
    out = {}
    for arm, (router, policy) in arm_sims.items():
        if arm not in arms:
            continue
        rows = [r for r in sim["results"] if r["policy"] == policy and r.get("router", router) == router]
        good = [g for g in sim.get("goodput", []) if g["policy"] == policy and g.get("router", router) == router]
        out[arm] = {
            "rates": [{"rate_scale": r["rate_scale"], "hit_ratio": r["token_hit_ratio"], "ttft_p90_s": r["ttft_p90_s"]}
                      for r in sorted(rows, key=lambda r: r["rate_scale"])],
            "goodput": good[0]["goodput_rate_scale"] if good else None,
        }
    return out


def _s(v: float | None, scale: float = 1.0, fmt: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, fmt)


def markdown(rep: dict) -> str:
    """The report's table: one row per arm and rate, live beside predicted."""
    pool = rep["pool_blocks"]
    lines = [
        f"# Live A/B: {rep['servers']} vLLM servers behind each router ({rep['trace_name']})", "",
        f"{rep['requests_per_run']} requests per run, {rep['tokens_per_id']} tokens per hash id, block size "
        f"{rep['block_size']}, {pool} KV blocks per server ({pool / max(1, rep['unique_blocks']):.1%} of the workload's "
        f"{rep['unique_blocks']} unique blocks), at most {rep['max_output_tokens']} output tokens; rate scales "
        f"{', '.join(f'{r:g}' for r in rep['rates'])} x {rep['rounds']} interleaved rounds. Unloaded TTFT "
        f"{rep['unloaded_ttft_s'] * 1000:.1f} ms; SLO TTFT p90 <= {rep['slo_multiple']:g} x = {rep['slo_ttft_s'] * 1000:.1f} ms.",
        "",
        f"Peers: {', '.join(f'{k} {v}' for k, v in rep['peers'].items()) or 'none run'}; vLLM {rep['vllm_version']}.",
        "",
        f"Regime: {rep.get('regime', '-')}." + (f" Every router at nice {rep['router_priority']} (the servers at 0)."
                                                 if rep.get("router_priority") else ""),
        "",
        "| arm | rate | hit ratio | sim hit ratio (GPU fit / fitted model) | TTFT p50 ms | TTFT p90 ms | "
        "sim TTFT p90 ms (GPU fit / calibrated / fitted model) | TTFT p99 ms | TTFT mean ms: client / router / in vLLM | "
        "E2E p50 ms | router CPU ms/req | router run-queue wait ms/req | router idle CPU % | backend time priced overdue % "
        "| requests | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in rep["arms"].items():
        sim = {r["rate_scale"]: r for r in rep.get("sim", {}).get("arms", {}).get(name, {}).get("rates", [])}
        cal = {r["rate_scale"]: r for r in (rep.get("sim_calibrated") or {}).get("arms", {}).get(name, {}).get("rates", [])}
        fit = {r["rate_scale"]: r for r in (rep.get("sim_fitted") or {}).get("arms", {}).get(name, {}).get("rates", [])}
        for r in a["rates"]:
            s, c, f = sim.get(r["rate_scale"], {}), cal.get(r["rate_scale"], {}), fit.get(r["rate_scale"], {})
            lines.append(
                f"| {name} | {r['rate_scale']:g} | {_s(r['hit_ratio'])} | {_s(s.get('hit_ratio'))} / {_s(f.get('hit_ratio'))} | "
                f"{_s(r['ttft_p50_s'], 1000, '.1f')} | {_s(r['ttft_p90_s'], 1000, '.1f')} | "
                f"{_s(s.get('ttft_p90_s'), 1000, '.1f')} / {_s(c.get('ttft_p90_s'), 1000, '.1f')} / "
                f"{_s(f.get('ttft_p90_s'), 1000, '.1f')} | "
                f"{_s(r['ttft_p99_s'], 1000, '.1f')} | {_s(r.get('ttft_mean_s'), 1000, '.1f')} / "
                f"{_s(r.get('router_ttft_mean_s'), 1000, '.1f')} / "
                f"{_s(r.get('server_ttft_mean_s'), 1000, '.1f')} | {_s(r['e2e_p50_s'], 1000, '.1f')} | "
                f"{_s(r['router_cpu_ms_per_request'], 1, '.2f')} | {_s(r.get('router_wait_ms_per_request'), 1, '.1f')} | "
                f"{_s(r['router_idle_cpu_pct'], 1, '.1f')} | {_s(r.get('router_overdue_share'), 100, '.1f')} | "
                f"{r['requests']} | {r['failed']} |")
    lines += ["", "| arm | goodput (rate scale) | sim goodput (GPU fit / calibrated / fitted model) |", "|---|---|---|"]
    for name, a in rep["arms"].items():
        sg = [(rep.get(k) or {}).get("arms", {}).get(name, {}).get("goodput") for k in ("sim", "sim_calibrated", "sim_fitted")]
        lines.append(f"| {name} | {a['goodput']:g} | {' / '.join('-' if g is None else format(g, 'g') for g in sg)} |")
    lines += ["", "95% bootstrap intervals over each (arm, rate)'s requests, all rounds pooled (bench/live_ab_stats.py); "
              "`ours` against each arm: better / worse only where the intervals do not overlap, else tie.", "",
              "| arm | rate | hit ratio CI | TTFT p50 CI ms | TTFT p90 CI ms | ours vs it: hit ratio / p50 / p90 |",
              "|---|---|---|---|---|---|"]
    vs = rep.get("verdicts") or {}
    for name, a in rep["arms"].items():
        per_rate = {v["rate_scale"]: v for v in vs.get(name, [])}
        for r in a["rates"]:
            v = per_rate.get(r["rate_scale"])
            cmp = "-" if v is None else " / ".join(v[f] for f, _, _ in COMPARED)
            lines.append(f"| {name} | {r['rate_scale']:g} | {_ci(r.get('hit_ratio_ci'))} | {_ci_ms(r.get('ttft_p50_ci_s'))} | "
                         f"{_ci_ms(r.get('ttft_p90_ci_s'))} | {cmp} |")
    for key, what in (("sim", "the paper's GPU prefill fit"), ("sim_calibrated", "timing fitted to the unloaded probe"),
                      ("sim_fitted", "the cost model our router fitted live (its last `ours` run's /v1/cluster/costs)")):
        if rep.get(key):
            lines.append(f"\nSimulator ({what}): `{rep[key]['command']}`.")
    lines += ["", f"Produced by `{rep['command']}` on {rep['host']} ({rep['cpus']} CPUs) at commit {rep['commit']}, "
              f"{rep['date']}; {rep['wall_s'] / 60:.1f} min wall.", ""]
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> None:
    """TTFT p90 against rate scale, one line per arm (the SLO dashed); hit ratio per arm at
    the lowest rate, live beside the simulator's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report_files import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, a in rep["arms"].items():
        pts = [(r["rate_scale"], r["ttft_p90_s"] * 1000) for r in a["rates"] if r["ttft_p90_s"] is not None]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=name)
    ax1.axhline(rep["slo_ttft_s"] * 1000, color="red", linestyle="--", label="SLO")
    ax1.set_xlabel("rate scale (x the trace's arrival rate)")
    ax1.set_ylabel("TTFT p90 (ms)")
    ax1.set_title("TTFT p90 against load")
    ax1.legend(fontsize=8)
    names = list(rep["arms"])
    live = [rep["arms"][n]["hit_ratio"] for n in names]
    sim_arms = rep.get("sim", {}).get("arms", {})
    sim = [sim_arms[n]["rates"][0]["hit_ratio"] if n in sim_arms and sim_arms[n]["rates"] else math.nan for n in names]
    xs = range(len(names))
    ax2.bar([x - 0.2 for x in xs], live, width=0.4, label="live (vLLM counters)")
    ax2.bar([x + 0.2 for x in xs], sim, width=0.4, label="unicache sim")
    ax2.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax2.set_ylabel("prefix-cache hit ratio (prompt tokens)")
    ax2.set_title(f"hit ratio at rate scale {min(rep['rates']):g}")
    ax2.legend(fontsize=8)
    save_figure(fig, path)
