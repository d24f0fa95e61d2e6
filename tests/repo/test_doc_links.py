"""Every relative link in the repository's markdown resolves: the file exists and, for a
``file.md#anchor`` link, the file has a heading with that GitHub anchor. Moving a module
or renaming a heading cannot leave a dead link behind."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.source_tree import REPO

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def markdown_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names if (REPO / n).is_file()]


def dead_links(files: list[Path]) -> list[str]:
    dead = []
    for md in files:
        for target in LINK.findall(FENCE.sub("", md.read_text())):
            if re.match(r"^[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue  # a URL (http:, mailto:) or a bare '#'
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(REPO)}: {target}"
            if not dest.exists():
                dead.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where} (no such heading)")
    return dead


def test_every_relative_link_in_the_docs_resolves():
    assert dead_links(markdown_files()) == []


def test_the_check_sees_a_dead_file_and_a_dead_anchor(tmp_path, monkeypatch):
    import tests.repo.test_doc_links as me

    monkeypatch.setattr(me, "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top heading (`x/y`)\n[ok](b.md) [ok](#top-heading-xy) [gone](c.md) [bad](b.md#nope)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert me.dead_links([tmp_path / "a.md"]) == ["a.md: c.md (no such file)", "a.md: b.md#nope (no such heading)"]
