"""The routing studies' shared command line (bench.studies.routing_admission.parse_tuning_run):
a study's own defaults, ``--variants`` choosing among its variants by name, ``--first-point``
moving the tuning points; and the variant studies' report (bootstrap interval, the
reference's line, the picks) on a hand-built result."""

from __future__ import annotations

import math

import pytest

from bench.studies.routing_admission import UNUSED_TUNING_POINTS, parse_tuning_run, tuning_traces
from bench.routing_report import cross_validate
from bench.studies.variant_study import bootstrap_ci95, markdown, summarise
from unicache.sim.suite import GENERATED_FAMILIES, suite_traces


def test_a_study_sets_its_own_defaults_and_the_command_line_still_wins():
    run = parse_tuning_run("doc", [], defaults={"capacity_frac": 0.05, "families": "mooncake"})
    assert run.args.capacity_frac == 0.05 and run.families == ["mooncake"]
    assert {t.family for t in run.traces} == {"mooncake"} and run.common["capacity_frac"] == 0.05
    run = parse_tuning_run("doc", ["--capacity-frac=0.02", "--families", "chat"],
                           defaults={"capacity_frac": 0.05, "families": "mooncake"})
    assert run.args.capacity_frac == 0.02 and run.families == ["chat"]
    assert not hasattr(run.args, "variants")  # only a study that names its variants has the option


def test_variants_are_chosen_by_name_and_unknown_names_are_refused(capsys):
    names = ["churn off", "load weight 0.5", "template homes off"]
    assert parse_tuning_run("doc", [], variants=names).args.variants is None  # all of them
    run = parse_tuning_run("doc", ["--variants", "load weight 0.5,template homes off"], variants=names)
    assert run.args.variants == ["load weight 0.5", "template homes off"]
    with pytest.raises(SystemExit):
        parse_tuning_run("doc", ["--variants=load weight 2"], variants=names)
    assert "unknown variants ['load weight 2']" in capsys.readouterr().err


def test_first_point_moves_the_generated_tuning_points_and_never_onto_a_report_point():
    run = parse_tuning_run("doc", ["--families", "chat,mooncake", "--points", "3", "--first-point", "4"])
    assert [t.name for t in run.traces] == ["chat-p1004-s1000", "chat-p1005-s1000", "chat-p1006-s1000",
                                            "mooncake-p0-s0", "mooncake-p1-s0"]
    assert all(t.role == "tune" for t in run.traces)
    assert [t.name for t in parse_tuning_run("doc", ["--families", "agent", "--points", "2"]).traces] == [
        "agent-p1000-s1000", "agent-p1001-s1000"]  # the default: the points every default was chosen on
    with pytest.raises(ValueError, match="first_point"):
        tuning_traces(1, 0, ["chat"], first_point=-1)


def test_bootstrap_interval_of_paired_ratios():
    lo, hi = bootstrap_ci95([math.log(1.1)] * 5)
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)  # no spread, no width
    ratios = [math.log(x) for x in (0.9, 1.0, 1.05, 1.1, 1.2, 0.95, 1.3, 1.0)]
    lo, hi = bootstrap_ci95(ratios)
    geo = math.exp(sum(ratios) / len(ratios))
    assert lo < geo < hi and 0.9 <= lo and hi <= 1.3
    assert bootstrap_ci95(ratios) == (lo, hi)  # seeded: a rerun gives the same interval
    assert bootstrap_ci95(ratios, seed=1) != (lo, hi)


def _row(goodput: float, hit: float) -> dict:
    return {"goodput_u": goodput, "at_u_ref": {"token_hit_ratio": hit}}


def test_variant_report_gives_interval_reference_line_and_picks():
    results = [{"family": fam, "trace": f"{fam}-p{p}", "by_replicas": {"4": {"rows": {
        "ref": _row(1.0, 0.5), "alt": _row(g, 0.52), "sglang+unicache": _row(0.8, 0.5)}}}}
        for fam, p, g in (("chat", 1004, 1.1), ("chat", 1005, 1.2), ("long", 1004, 0.9))]
    summary = summarise(results, "4", ["alt", "ref"], "ref")
    alt = summary["alt"]["all"]
    assert alt["vs_default"] == pytest.approx((1.1 * 1.2 * 0.9) ** (1 / 3))
    assert alt["traces_above_default"] == 2 and alt["traces_below_default"] == 1
    assert alt["hit_pts_vs_default"] == pytest.approx(2.0)
    assert summary["ref"]["families"]["chat"]["vs_sglang_unicache"] == pytest.approx(1.25)
    cv = cross_validate(results, ["alt", "ref"], "4")
    report = {"command": "c", "host": "h", "cpus": 2, "workers": 2, "commit": "x", "wall_s": 60.0,
              "traces": [r["trace"] for r in results], "default": "ref", "summary": {"4": summary},
              "held_out_picks": {"4": cv["lofo"]},
              "overall_picks": {"4": {"pick": cv["overall_pick"], "scores": cv["overall_scores"]}}}
    md = markdown(report, "t")
    lo, hi = alt["vs_default_ci95"]
    assert f"| alt | {alt['vs_default']:.3f} | {lo:.3f}-{hi:.3f} |" in md
    assert "ref / sglang+unicache by family: chat 1.250, long 1.250." in md
    assert "chat -> **ref**" in md and "long -> **alt**" in md  # each family's pick is the other's best
    assert "All families: pick **alt**" in md


def test_unused_tuning_points_miss_every_trace_the_routing_report_uses():
    run = parse_tuning_run("doc", [], defaults=UNUSED_TUNING_POINTS)
    assert len(run.traces) == 6 * 8 and {t.point for t in run.traces} == set(range(1004, 1012))
    assert {t.family for t in run.traces} == set(GENERATED_FAMILIES)
    report_suite = suite_traces(points=2, seeds=2, tune_points=4, mooncake_slices=(1, 1))  # the report's defaults
    assert not {t.name for t in run.traces} & {t.name for t in report_suite}
