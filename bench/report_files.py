"""The files a bench report leaves behind: one definition for every report script.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_report(out_dir: Path, stem: str, report: dict, markdown: str,
                 plot: Callable[[dict, Path], None] | None = None) -> None:
    """Write ``<stem>.json`` (the report), ``<stem>.md`` (``markdown``) and, given ``plot``,
    ``<stem>.png`` under ``out_dir``; then print the markdown."""
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
    if plot is not None:
        plot(report, out_dir / f"{stem}.png")
    print(markdown)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (110 dpi, the size every bench figure uses) and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
