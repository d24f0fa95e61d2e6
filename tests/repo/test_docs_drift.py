"""Docs that cannot drift from the code: the replica's ``--eviction-policy`` help names
every registered policy, the README stays a short page for users, and nothing cites a
design file that users' clones do not have."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess

from unicache.replica.eviction.registry import policy_names
from unicache.replica.settings import ReplicaSettings
from tests.support.source_tree import REPO


def test_the_eviction_policy_help_names_every_registered_policy():
    field = next(f for f in dataclasses.fields(ReplicaSettings) if f.name == "eviction_policy")
    named = set(re.findall(r"[a-z0-9][a-z0-9-]*", field.metadata["help"]))
    assert set(policy_names()) <= named
    assert {"unicache", "lru", "radix-lru", "arc", "s3fifo", "opt", "vllm"} <= named


def test_the_readme_is_short_and_free_of_study_narrative():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert not re.search(r"\b[Ii]ssues? #?\d", readme)
    assert "bench.studies" not in readme


def test_nothing_cites_a_design_file_outside_the_repository():
    out = subprocess.run(["git", "grep", "-l", "DESIGN" + ".md", "--", "*.py", "*.md", "*.toml", "*.txt"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.stdout.split() == []


# --- what the user-facing pages cite -------------------------------------------------------
# The pages a user reads: the README, CONTRIBUTING, docs/ and the packages' READMEs
# (bench/results/ holds the reports benchmarks wrote, as they wrote them; tests/schemas and
# traces cite other repositories' commits, where the files came from).
USER_PAGES = ("README.md", "CONTRIBUTING.md", "docs/**/*.md",
              *(f"{folder}/**/README.md" for folder in ("router", "replica", "unicache", "proto", "helm", "docker")), "bench/README.md")
CITED_PATH = re.compile(r"(?<![\w/.-])((?:bench|tools)/[\w/.-]*\w\.py)\b")
CITED_MODULE = re.compile(r"(?:python -m |`)((?:bench|tools)\.[A-Za-z_][\w.]*)")
COMMIT_HASH = re.compile(r"(?<![\w#/.:=-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
FOUND_IN_HISTORY = "git log --all"  # a paragraph that says how to find removed code may cite it


def user_pages(root=REPO) -> list:
    return sorted({p for pattern in USER_PAGES for p in root.glob(pattern) if p.is_file()})


def paragraphs(text: str) -> list[str]:
    return re.split(r"\n\s*\n", text)


def module_exists(dotted: str, root=REPO) -> bool:
    """Some prefix of ``dotted`` (two parts or more) is a module or package under ``root``."""
    parts = dotted.rstrip(".").split(".")
    return any(
        root.joinpath(*parts[:n]).with_suffix(".py").is_file() or (root.joinpath(*parts[:n]) / "__init__.py").is_file()
        for n in range(len(parts), 1, -1)
    )


def missing_citations(pages, root=REPO) -> list[str]:
    """``bench/x.py``, ``tools/x.py``, ``python -m bench.x`` and ``bench.x`` the pages cite
    that do not exist (unless the paragraph says how to find them in git's history)."""
    out = []
    for page in pages:
        for para in paragraphs(page.read_text()):
            if FOUND_IN_HISTORY in para:
                continue
            for path in CITED_PATH.findall(para):
                if not (root / path).is_file():
                    out.append(f"{page.relative_to(root)}: {path}")
            for dotted in CITED_MODULE.findall(para):
                if not module_exists(dotted, root):
                    out.append(f"{page.relative_to(root)}: {dotted}")
    return out


def cited_commits(pages, root=REPO) -> list[str]:
    return [f"{page.relative_to(root)}: {m.group(0)}" for page in pages for m in COMMIT_HASH.finditer(page.read_text())]


def test_every_file_and_benchmark_the_docs_cite_exists():
    assert missing_citations(user_pages()) == []


def test_the_docs_cite_no_commit_hash():
    """A user needs the command and the date of a figure, not a commit of the project."""
    assert cited_commits(user_pages()) == []


def test_the_citation_checks_see_what_is_gone(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "here.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python -m bench.here --x 1` or `bench.here.main` and read bench/here.py.\n"
        "Run `python -m bench.gone` or `bench/gone.py`, tools/old.py, at 8de64ab (#1f77b4 is a colour, 1234567 a count).\n\n"
        "Removed: `bench/studies/x.py` (`git log --all -- bench/studies/x.py`).\n"
    )
    assert missing_citations([page], tmp_path) == ["page.md: bench/gone.py", "page.md: tools/old.py", "page.md: bench.gone"]
    assert cited_commits([page], tmp_path) == ["page.md: 8de64ab"]


# --- headline figures: one value wherever they are stated ------------------------------------
# Each entry: the figure, its value from the results file the benchmark wrote, and the forms
# a page states it in (each regex's groups read the figure as the page gives it). Every
# statement on every user page must give the results file's value.
def _router_overhead() -> tuple[str, str]:
    paths = json.loads((REPO / "bench/results/router_overhead.json").read_text())["paths"]
    return tuple(f"{paths[p]['added_p50_ms_vs_its_hop']:.2f}" for p in ("router_grpc", "router_http"))


HEADLINE_FIGURES = {
    "router added latency p50, gRPC / HTTP (python -m bench.router_overhead)": (
        _router_overhead,
        [
            r"latency the router adds, one request at a time \(gRPC / HTTP\) \| ([\d.]+) / ([\d.]+) ms",
            r"the router adds ([\d.]+) / ([\d.]+) ms at p50 \(gRPC / HTTP\)",
            r"\| router_grpc \|[^\n]*\| ([\d.]+) ms \|\n\| router_http \|[^\n]*\| ([\d.]+) ms \|",
            r"\| router gRPC \|[^\n|]*\|\s*([\d.]+)\s*\|[^\n]*\n\| router HTTP[^|]*\|[^\n|]*\|\s*([\d.]+)\s*\|",
        ],
    ),
    "cache_aware decision p50 / p99 at 1,024 replicas x 100,000 blocks, us (python -m bench.fleet_scale)": (
        lambda: ("119", "265"),
        [
            r"routing decision at 1,024 replicas x 100,000 indexed blocks \| (\d+) / (\d+) us p50 / p99",
            r"\| cache_aware decision p50 / p99 \|[^\n]*\*\*(\d+) / (\d+) µs\*\* \(target",
        ],
    ),
    "Redis killed and restarted: requests failed of all, index rebuilt after (python -m bench.faults)": (
        lambda: ("0", "136", "0.84"),
        [
            r"(\d+) of (\d+) requests failed; index rebuilt ([\d.]+) s after restart",
            r"Redis killed during traffic, then restarted \|[^\n]*\| (\d+) of (\d+) failed;[^\n|]*index == caches ([\d.]+) s after restart",
        ],
    ),
}


def figure_statements(pages, forms: list[str], root=REPO) -> list[tuple[str, tuple[str, ...]]]:
    return [(str(page.relative_to(root)), m.groups()) for page in pages for form in forms for m in re.finditer(form, page.read_text())]


def test_headline_figures_agree_with_their_results_wherever_stated():
    """Every headline figure is stated in the README and docs/results.md at least (the router
    overhead also in docs/performance.md and docs/router.md, checked below), and wherever
    it is stated it has one value."""
    pages = user_pages()
    for name, (value, forms) in HEADLINE_FIGURES.items():
        stated = figure_statements(pages, forms)
        assert {page for page, _ in stated} >= {"README.md", "docs/results.md"}, name
        assert [(page, got) for page, got in stated if got != value()] == [], name
    overhead = figure_statements(pages, HEADLINE_FIGURES["router added latency p50, gRPC / HTTP (python -m bench.router_overhead)"][1])
    assert {page for page, _ in overhead} >= {"docs/performance.md", "docs/router.md"}


def test_the_figure_check_sees_a_page_that_disagrees(tmp_path):
    _value, forms = HEADLINE_FIGURES["router added latency p50, gRPC / HTTP (python -m bench.router_overhead)"]
    (tmp_path / "a.md").write_text("| latency the router adds, one request at a time (gRPC / HTTP) | 2.34 / 3.59 ms p50 |\n")
    (tmp_path / "b.md").write_text("| path | p50 | added |\n| router gRPC | 6.26 | 0.96 | 1.18 |\n| router HTTP (httpx) | 8.01 | 2.71 | 1.51 |\n")
    assert figure_statements([tmp_path / "a.md", tmp_path / "b.md"], forms, tmp_path) == [("a.md", ("2.34", "3.59")), ("b.md", ("0.96", "2.71"))]
