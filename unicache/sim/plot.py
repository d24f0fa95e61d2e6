"""``--plot``: block hit ratio against capacity, one line per policy (and router)."""

from __future__ import annotations

from collections.abc import Sequence


def plot_hit_ratio(results: Sequence[dict], unique_blocks: int, path: str, title: str = "") -> None:
    """Draw hit ratio (y) against capacity in % of unique blocks (x) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        label = r["policy"] if "router" not in r else f"{r['policy']} / {r['router']}"
        lines.setdefault(label, []).append((100.0 * r["capacity_blocks"] / unique_blocks, r["block_hit_ratio"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [100.0 * p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("block hit ratio (%)")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_vs_rate(results: Sequence[dict], path: str, slo_s: float | None = None, title: str = "") -> None:
    """Draw TTFT p90 (y, log) against the arrival-rate scale (x, log), one line per
    router + policy (+ capacity when several), with the SLO as a dashed line; save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = {r["capacity_blocks"] for r in results}
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        label = r["policy"] if "router" not in r else f"{r['router']} + {r['policy']}"
        if len(caps) > 1:
            label += f" @ {r['capacity_blocks']}"
        lines.setdefault(label, []).append((r["rate_scale"], r["ttft_p90_s"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if slo_s is not None:
        ax.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:.3g} s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate scale (x recorded rate)")
    ax.set_ylabel("TTFT p90 (s)")
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
