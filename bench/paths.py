"""Where the benchmarks read and write: one definition for every bench script.

``REPO`` is the checkout holding this ``bench/`` package; reports go under
``RESULTS`` (``bench/results``). The Mooncake trace is not in the repository: it is read
from ``shared/traces/`` in the nearest folder at or above the checkout that has one (the
main tree keeps it beside itself, a worktree further up), and every script that reads it
also takes ``--trace PATH``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MOONCAKE_RELATIVE = Path("shared") / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"


def mooncake_trace() -> Path:
    """The Mooncake conversation trace nearest to the checkout (the path under the
    checkout itself when none exists, so the error names where it was expected)."""
    for folder in (REPO, *REPO.parents):
        if (folder / MOONCAKE_RELATIVE).is_file():
            return folder / MOONCAKE_RELATIVE
    return REPO / MOONCAKE_RELATIVE

