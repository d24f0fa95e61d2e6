"""bench.ab_commits: the per-round comparison and the command it runs on each side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.ab_commits import compare, dig, run_side


def test_compare_gives_per_round_ratios_and_medians():
    rounds = [
        {"base": {"m": {"cpu": 2.0}}, "head": {"m": {"cpu": 1.0}}},
        {"base": {"m": {"cpu": 4.0}}, "head": {"m": {"cpu": 5.0}}},
        {"base": {"m": {"cpu": 1.0}}, "head": {"m": {"cpu": 0.8}}},
    ]
    got = compare(rounds, ["m.cpu"])["m.cpu"]
    assert got["ratios"] == [0.5, 1.25, 0.8]
    assert got["median_ratio"] == 0.8
    assert (got["base_median"], got["head_median"], got["head_lower_in"]) == (2.0, 1.0, 2)


def test_dig_reads_a_dotted_path_and_fails_on_a_missing_one():
    assert dig({"a": {"b": 3}}, "a.b") == 3.0
    with pytest.raises(KeyError):
        dig({"a": {}}, "a.b")


def test_run_side_substitutes_the_interpreter_and_the_output_path(tmp_path: Path):
    out = tmp_path / "r.json"
    script = "import json, os, sys; json.dump({'cwd': os.getcwd(), 'exe': sys.executable}, open(sys.argv[1], 'w'))"
    got = run_side(Path(sys.executable), tmp_path, ["python", "-c", script, "{out}"], out)
    assert got == {"cwd": str(tmp_path), "exe": sys.executable}
    assert json.loads(out.read_text()) == got


def test_run_side_raises_with_the_commands_stderr(tmp_path: Path):
    with pytest.raises(RuntimeError, match="boom"):
        run_side(Path(sys.executable), tmp_path, ["python", "-c", "import sys; sys.exit('boom')", "{out}"], tmp_path / "x")
