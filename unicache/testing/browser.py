"""Debian's Chromium, headless, for the dashboard test and its screenshot.

``chromium --headless`` loads a page, lets its scripts run for ``budget_ms`` of virtual
time (fetches complete, timers fire), then dumps the DOM or writes a PNG. Nothing but the
page's own origin is reached. ``find_chromium`` returns None when no browser is installed
(``.ci/run`` installs Debian's ``chromium`` package); the helpers then fail saying so.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from html.parser import HTMLParser

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium() -> str:
    path = find_chromium()
    if path is None:
        raise RuntimeError("no chromium found: apt-get install chromium (.ci/run does)")
    return path


def _args(budget_ms: int, profile: str) -> list[str]:
    return [
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
    ]


async def _run(cmd: list[str], timeout_s: float) -> bytes:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise TimeoutError(f"chromium did not finish within {timeout_s}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    return out


async def dump_dom(url: str, budget_ms: int = 4000, timeout_s: float = 120.0) -> str:
    """The page's DOM after its scripts ran (``--dump-dom``)."""
    with tempfile.TemporaryDirectory(prefix="uc-chrome-") as profile:
        out = await _run([_chromium(), *_args(budget_ms, profile), "--dump-dom", url], timeout_s)
    return out.decode()


async def screenshot(url: str, path: str, width: int = 1400, height: int = 1300, budget_ms: int = 4000, timeout_s: float = 120.0) -> None:
    """Write a PNG of the page at ``width`` x ``height`` to ``path``."""
    with tempfile.TemporaryDirectory(prefix="uc-chrome-") as profile:
        await _run(
            [_chromium(), *_args(budget_ms, profile), f"--window-size={width},{height}", f"--screenshot={path}", url],
            timeout_s,
        )


class ChartParser(HTMLParser):
    """Collects the dashboard's charts from a DOM dump: ``charts[name]`` is a list of
    ``(series label, points drawn)`` in document order (router/observability/dashboard.py's contract),
    ``legends[name]`` the legend's text."""

    def __init__(self):
        super().__init__()
        self.charts: dict[str, list[tuple[str, int]]] = {}
        self.legends: dict[str, str] = {}
        self._chart: str | None = None
        self._last_chart: str | None = None
        self._in_legend = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "svg" and "chart" in classes:
            self._chart = a.get("data-chart", "")
            self.charts[self._chart] = []
        elif tag == "path" and "series" in classes and self._chart is not None:
            self.charts[self._chart].append((a.get("data-series", ""), int(a.get("data-points", "0"))))
        elif tag == "div" and "legend" in classes and self._last_chart is not None:
            # NOTE: a legend holds spans only, so it ends at the next </div>.
            self._in_legend = True
            self.legends[self._last_chart] = ""

    def handle_endtag(self, tag):
        if tag == "svg" and self._chart is not None:
            self._last_chart, self._chart = self._chart, None
        elif tag == "div":
            self._in_legend = False

    def handle_data(self, data):
        if self._in_legend and data.strip():
            self.legends[self._last_chart] = (self.legends[self._last_chart] + " " + data.strip()).strip()


def parse_charts(dom: str) -> ChartParser:
    p = ChartParser()
    p.feed(dom)
    return p
