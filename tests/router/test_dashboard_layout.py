"""``/dashboard``'s page text and layout rules (the browser test, tests/e2e/test_dashboard_browser.py,
draws it): its two hit ratios are named apart, and its panels fill the page's width."""

from __future__ import annotations

import re

from unicache.router.observability.dashboard import DASHBOARD_HTML


def test_the_two_hit_ratios_are_named_apart():
    header = re.search(r"<thead>(.*?)</thead>", DASHBOARD_HTML, flags=re.S).group(1)
    assert "block hit ratio<br><small>replica, since start</small>" in header
    assert ">hit ratio<" not in header  # no bare "hit ratio" left
    assert "chart('hit_ratio', 'Prompt-token hit ratio at the router (cached / prompt tokens of the requests finished per interval)'" in DASHBOARD_HTML
    key = re.search(r'<div class="keyrow">(.*?)</div>', DASHBOARD_HTML, flags=re.S).group(1)
    assert "<b>block hit ratio</b>: the replica's cached" in key and "<b>prompt-token hit ratio</b> (chart below): the router's" in key


def test_the_panels_fill_the_page_width():
    css = re.search(r"<style>(.*?)</style>", DASHBOARD_HTML, flags=re.S).group(1)
    grid = re.search(r"\.grid \{([^}]*)\}", css).group(1)
    assert "max-width" not in grid and "grid-template-columns: repeat(auto-fill, minmax(420px, 1fr))" in grid
    panel = re.search(r"\.panel \{([^}]*)\}", css).group(1)
    assert not re.search(r"(?<![-\w])width:", panel)  # no fixed panel width: the grid's columns size it
    assert "svg.chart { width: 100%; height: auto;" in css  # charts scale with their panel (viewBox)
    # every replica's panels share one grid, so they flow across the width too
    assert '<div class="grid" id="replica-charts"></div>' in DASHBOARD_HTML
    assert "per += '<div class=\"grid\">'" not in DASHBOARD_HTML
