"""Do issue 13's routing figures hold at a KV capacity nobody tuned on?

Every routing default was chosen on tuning traces, and every report figure measured, with
each replica's KV cache at 2% of the trace's unique blocks (``bench.routing_report``'s
``--capacity-frac``). Capacity decides what binds: at 2% KV memory fills before prefill on
every family (``bench.studies.kv_admission``), so fit-first, the footprint term and the
eviction discount all act on a scarce cache. This study replays the routing report's own
report traces, on the simulator's lanes model and with its SLO rule, at another capacity
with ``cache_aware``'s shipped default for every family (nothing is chosen here) against
sglang + unicache, sglang + lru and the pooled replica, and scores the same six targets
per family (``bench.studies.step_service.run_shipped_default``). The load axis u is
renormalised per capacity (``bench.routing_report.nominal_scale``), so goodput ratios
compare routers, not capacities. A replica never gets less than twice the trace's largest
request (``bench.routing_report.capacity_floor_blocks``), and on most generated traces that
floor, not the fraction, sets the capacity: the report lists the traces whose capacity the
fraction moved from the tuned one; every other row replays exactly as at 2%.

Writes ``capacity_shift_<percent>pct.{json,md}`` to ``--out-dir``.

Run (from the repository root, niced):
    nice -n 10 .venv/bin/python -m bench.studies.capacity_shift --capacity-frac 0.05 [--workers 2] [--replicas 4,8]
"""

from __future__ import annotations

import argparse
import sys

from bench.routing_report import add_suite_args, capacity_of, parse_suite_args
from bench.studies.step_service import run_shipped_default

TUNED_CAPACITY_FRAC = 0.02


def moved_traces(report: dict) -> list[dict]:
    """The traces whose capacity differs from the tuned fraction's: each with both."""
    out = []
    for r in report["results"]:
        tuned = capacity_of(r["unique_blocks"], r["capacity_floor_blocks"], TUNED_CAPACITY_FRAC)
        if tuned != r["capacity_blocks"]:
            out.append({"trace": r["trace"], "family": r["family"], "tuned_blocks": tuned, "blocks": r["capacity_blocks"]})
    return out


def notes(report: dict) -> str:
    moved = moved_traces(report)
    fams = sorted({m["family"] for m in moved})
    lines = [f"Capacity moved from the tuned {100 * TUNED_CAPACITY_FRAC:g}% on {len(moved)} of {report['traces']} traces "
             f"(families {', '.join(fams) or 'none'}); every other trace is floored at twice its largest request at "
             "both fractions and replays as at the tuned one:", ""]
    lines += [f"- {m['trace']}: {m['tuned_blocks']} -> {m['blocks']} blocks per replica" for m in moved]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(ap)
    ap.add_argument("--capacity-frac", type=float, default=0.05,
                    help=f"each replica's KV blocks as a share of the trace's unique blocks (default 0.05; "
                         f"the defaults were tuned at {TUNED_CAPACITY_FRAC})")
    args = parse_suite_args(ap, argv)
    if not 0.0 < args.capacity_frac <= 1.0:
        ap.error("--capacity-frac must be in (0, 1]")
    pct = f"{100 * args.capacity_frac:g}"
    return run_shipped_default(
        "bench.studies.capacity_shift", argv, args, f"capacity_shift_{pct}pct",
        f"Routing with each replica's KV cache at {pct}% of unique blocks (tuned at {100 * TUNED_CAPACITY_FRAC:g}%)",
        "lanes model, the routing report's SLO rule.", notes=notes, capacity_frac=args.capacity_frac)


if __name__ == "__main__":
    sys.exit(main())
