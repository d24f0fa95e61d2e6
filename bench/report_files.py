"""The files a bench report leaves behind: one definition for every report script.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path


def write_report(out_dir: Path, stem: str, report: dict, markdown: str,
                 plot: Callable[[dict, Path], None] | None = None) -> None:
    """Write ``<stem>.json`` (the report), ``<stem>.md`` (``markdown``) and, given ``plot``,
    ``<stem>.png`` under ``out_dir`` (created if missing); then print the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
    if plot is not None:
        plot(report, out_dir / f"{stem}.png")
    print(markdown)


def produced_by(report: dict) -> str:
    """The line that says how a report was made: its ``command``, ``host``, ``cpus`` (and
    ``workers`` where it has them), ``commit`` and ``wall_s``."""
    workers = f", {report['workers']} workers" if "workers" in report else ""
    return (f"Produced by `{report['command']}` on {report['host']} ({report['cpus']} CPUs{workers}) at commit "
            f"{report['commit']}; {report['wall_s'] / 60:.1f} min wall.")


def save_figure(fig, path: Path) -> None:
    """Lay out, write (110 dpi, the size every bench figure uses) and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit(repo: Path) -> str:
    """``repo``'s HEAD, marked ``+dirty`` when tracked files differ from it (results depend on them)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"
