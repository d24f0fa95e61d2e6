"""Docs that cannot drift from the code: the replica's ``--eviction-policy`` help names
every registered policy, the README stays a short page for users, and nothing cites a
design file that users' clones do not have."""

from __future__ import annotations

import dataclasses
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
