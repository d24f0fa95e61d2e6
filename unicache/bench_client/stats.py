"""What one ``unicache bench`` run measured: per-request records, the summary, the table and
the TTFT CDF plot.

Definitions (all times in seconds; percentiles are nearest-rank, ``unicache.sim.metrics``):
  * TTFT: request sent -> first streamed chunk carrying text; ITL: the gaps between a
    request's consecutive text chunks, pooled over requests; E2E: sent -> stream end.
    Latencies are over successful requests only; failures are counted, never dropped.
  * duration: first request sent -> last request ended (0 requests: 0).
  * throughput: successful requests / duration; output tok/s: their completion tokens /
    duration; goodput: successful requests whose TTFT <= the SLO, per second of duration.
  * cached tokens: the sum of ``usage.prompt_tokens_details.cached_tokens`` over the requests
    whose server reported it (``cached_reported`` of them).
  * failures: ``errors`` counts them by kind (``http 400``, ``stream error``, ``timeout``,
    ...); ``error_details`` by kind and the server's error code, with the first message.
  * overload: ``refused`` counts the requests answered 429 (refused before any token, to
    retry later), ``refused_share`` their share of all requests; ``deadline_expired`` the
    requests that ran out of time instead (the client's timeout, or the server's 504).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from unicache.sim.metrics import percentile

QUANTILES = (50.0, 90.0, 99.0)
REFUSED = "http 429"  # refused before any token (overloaded, or a tenant limit): retry later
EXPIRED = frozenset({"timeout", "http 504"})  # the client's deadline, or the server's


@dataclass(slots=True)
class RequestRecord:
    """One replayed request. ``error`` is None when it succeeded; a failure keeps the
    server's error ``code`` and ``message`` where it sent them (OpenAI's error body or
    stream event), else what the client saw."""

    index: int
    sent_s: float  # since the run started
    end_s: float = math.nan
    ttft_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict:
        """JSON-ready: NaN times (never reached) become None."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def distribution(values: list[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` of ``values`` (None each when empty)."""
    if not values:
        return {"mean": None, **{f"p{q:g}": None for q in QUANTILES}}
    return {"mean": sum(values) / len(values), **{f"p{q:g}": percentile(values, q) for q in QUANTILES}}


def summarize(records: list[RequestRecord], slo_ttft_s: float) -> dict:
    """The summary dict of a run (see the module docstring for every definition)."""
    ok = [r for r in records if r.ok]
    duration = (max(r.end_s for r in records) - min(r.sent_s for r in records)) if records else 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    reported = [r for r in ok if r.cached_tokens is not None]
    output_tokens = sum(r.completion_tokens for r in ok)
    good = sum(1 for r in ok if r.ttft_s <= slo_ttft_s)
    refused = sum(1 for r in records if r.error == REFUSED)
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "error_details": error_details(records),
        "refused": refused,
        "refused_share": refused / len(records) if records else 0.0,
        "deadline_expired": sum(1 for r in records if r.error in EXPIRED),
        "duration_s": duration,
        "ttft_s": distribution([r.ttft_s for r in ok]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "e2e_s": distribution([r.end_s - r.sent_s for r in ok]),
        "throughput_rps": per_s(len(ok)),
        "output_tokens": output_tokens,
        "output_tps": per_s(output_tokens),
        "slo_ttft_s": slo_ttft_s,
        "good_requests": good,
        "goodput_rps": per_s(good),
        "cached_reported": len(reported),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in reported),
        "cached_tokens": sum(r.cached_tokens for r in reported),
    }


def error_details(records: list[RequestRecord]) -> list[dict]:
    """One entry per (kind, server code) of the failures: ``error``, ``code``, ``count`` and
    the first ``message``, most frequent first."""
    groups: dict[tuple[str, str | None], dict] = {}
    for r in records:
        if r.ok:
            continue
        g = groups.setdefault((r.error, r.error_code), {"error": r.error, "code": r.error_code, "count": 0, "message": r.error_message})
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: (-g["count"], g["error"], g["code"] or ""))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(summary: dict) -> str:
    """The stdout table of a summary."""
    lines = [
        f"requests  {summary['requests']}  succeeded {summary['succeeded']}  failed {summary['failed']}"
        + (f"  ({', '.join(f'{k}: {n}' for k, n in summary['errors'].items())})" if summary["errors"] else ""),
    ]
    for d in summary.get("error_details", []):
        message = d["message"] or ""
        message = message if len(message) <= 160 else message[:157] + "..."
        lines.append(f"  {d['count']} x {d['error']}" + (f" {d['code']}" if d["code"] else "") + (f": {message}" if message else ""))
    if summary["refused"] or summary["deadline_expired"]:
        lines.append(f"refused (429)   {summary['refused']} of {summary['requests']} ({summary['refused_share']:.1%}); "
                     f"deadline expired {summary['deadline_expired']}")
    lines.append(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        d = summary[key]
        lines.append(f"{name:<14}" + "".join(f"{_ms(d[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    lines += [
        f"duration        {summary['duration_s']:.2f} s",
        f"throughput      {summary['throughput_rps']:.2f} req/s, {summary['output_tps']:.1f} output tok/s",
        f"goodput         {summary['goodput_rps']:.2f} req/s with TTFT <= {summary['slo_ttft_s']:g} s "
        f"({summary['good_requests']} of {summary['requests']} requests)",
    ]
    if summary["cached_reported"]:
        ratio = summary["cached_tokens"] / summary["prompt_tokens"] if summary["prompt_tokens"] else 0.0
        lines.append(f"cached tokens   {summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens "
                     f"({ratio:.1%}; reported by {summary['cached_reported']} requests)")
    else:
        lines.append("cached tokens   not reported by the server")
    return "\n".join(lines)


def plot_ttft_cdf(records: list[RequestRecord], path: str, slo_ttft_s: float) -> None:
    """Write the empirical CDF of the successful requests' TTFT to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttfts = sorted(r.ttft_s * 1000 for r in records if r.ok)
    fig, ax = plt.subplots(figsize=(6, 4))
    if ttfts:
        ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label="TTFT")
    ax.axvline(slo_ttft_s * 1000, color="red", linestyle="--", label=f"SLO {slo_ttft_s:g} s")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of successful requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT CDF ({len(ttfts)} of {len(records)} requests succeeded)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
