"""bench/ as a suite: modules of one package that import the installed ``unicache``.

No bench module edits ``sys.path`` or imports ``tests``; bench/README.md indexes every
module; every ``python -m bench.*`` command in the docs names a module that exists; and no
study code is left in it (studies leave once answered: docs/studies.md).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.support.source_tree import REPO

BENCH = REPO / "bench"
HELPERS = {"bench.paths", "bench.report_files", "bench.rounds", "bench.workers", "bench.bare_http"}


def bench_modules() -> list[str]:
    mods = []
    for path in sorted(BENCH.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        if any(part.startswith(".") for part in rel.parts):
            continue  # a hidden folder: a virtual environment (bench.live_ab's peers), not bench code
        if rel.name != "__init__":
            mods.append(".".join(rel.parts))
    return mods


def module_path(module: str):
    return REPO.joinpath(*module.split(".")).with_suffix(".py")


def imported_roots(module: str) -> set[str]:
    tree = ast.parse(module_path(module).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def edits_sys_path(module: str) -> bool:
    tree = ast.parse(module_path(module).read_text())
    return any(
        isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"
        for node in ast.walk(tree)
    )


def test_the_suite_has_its_benchmarks_and_no_study_code():
    mods = bench_modules()
    assert {"bench.eviction_report", "bench.routing_report", "bench.faults"} <= set(mods)
    assert HELPERS <= set(mods)
    assert not [m for m in mods if m.startswith("bench.studies")]
    assert not {"bench.mooncake_bound", "bench.routing_gap", "bench.routing_footprint", "bench.unicache_ablation",
                "bench.unicache_variants", "bench.eviction_tuning"} & set(mods)


@pytest.mark.parametrize("module", bench_modules())
def test_bench_modules_import_the_package_not_tests_and_leave_sys_path_alone(module):
    assert "tests" not in imported_roots(module)
    assert not edits_sys_path(module)


def test_bench_readme_indexes_every_module():
    index = (BENCH / "README.md").read_text()
    missing = [m for m in bench_modules() if f"`{m}`" not in index]
    assert missing == []


def documented_commands() -> set[str]:
    docs = [REPO / "README.md", BENCH / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = set()
    for doc in docs:
        found.update(re.findall(r"python -m (bench(?:\.\w+)+)", doc.read_text()))
    return found


def test_every_documented_bench_command_names_a_module():
    commands = documented_commands()
    assert "bench.eviction_report" in commands and "bench.routing_report" in commands
    assert sorted(c for c in commands if c not in bench_modules()) == []
    assert not re.search(r"python\s+bench/", (REPO / "README.md").read_text())


def test_a_bench_module_runs_as_a_module_from_the_repo_root():
    out = subprocess.run([sys.executable, "-m", "bench.eviction_report", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--fracs" in out.stdout


def test_round_order_puts_each_variant_in_each_position_once_per_cycle():
    from bench.rounds import round_order

    names = ["a", "b", "c"]
    orders = [round_order(names, k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert names == ["a", "b", "c"] and round_order((), 5) == []


def _square(x: int) -> int:
    return x * x


def test_map_in_workers_keeps_the_order_in_process_and_in_workers():
    from bench.workers import map_in_workers

    items = [5, 1, 4, 2, 3]
    assert map_in_workers(_square, items, 1) == [25, 1, 16, 4, 9]
    assert map_in_workers(_square, items, 2) == [25, 1, 16, 4, 9]
    assert map_in_workers(_square, [], 2) == []


def test_committed_results_stay_small():
    """bench/results keeps the markdown summaries and the plots the docs show; bulky raw
    JSON is not committed (a rerun writes it; git history keeps the old runs')."""
    out = subprocess.run(["git", "ls-files", "-z", "bench/results"], cwd=REPO, capture_output=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = [REPO / p for p in out.stdout.decode().split("\0") if p]
    sizes = {f.relative_to(REPO).as_posix(): f.stat().st_size for f in files if f.exists()}
    assert sum(sizes.values()) < 8 * 2**20
    assert [p for p, size in sizes.items() if p.endswith(".json") and size > 200_000] == []
