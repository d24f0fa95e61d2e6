"""The routing studies' shared command line (bench.studies.routing_admission.parse_tuning_run):
a study's own defaults, and ``--variants`` choosing among its variants by name."""

from __future__ import annotations

import pytest

from bench.studies.routing_admission import parse_tuning_run


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
