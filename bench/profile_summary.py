"""Where a process's CPU went, from a py-spy profile in collapsed-stack form
(``py-spy record --format raw``): the share of samples per function, inclusive (the
function or anything it called was on the CPU) and self (it was the innermost frame),
project functions and the libraries' alike.

    py-spy record --pid PID --duration 30 --rate 200 --format raw --output prof.txt
    .venv/bin/python -m bench.profile_summary prof.txt [--top 25] [--under unicache/router]

Each line of the file is ``frame;frame;...;frame COUNT``, outermost first, a frame being
``function (file:line)``. A function is counted once per sample however often it recurs.
``--under`` keeps, in the inclusive table, only functions whose file path contains it.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def frame_key(frame: str) -> tuple[str, str]:
    """(function, file) of a frame; the line number is dropped so a function is one key."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip(), ""
    return m.group("fn"), m.group("file")


def summarize(lines, under: str = "") -> tuple[int, Counter, Counter]:
    """(samples, inclusive counts, self counts) over collapsed-stack ``lines``."""
    inclusive: Counter = Counter()
    self_: Counter = Counter()
    total = 0
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        total += n
        frames = [frame_key(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_[frames[-1]] += n
        for key in set(frames):
            if not under or under in key[1]:
                inclusive[key] += n
    return total, inclusive, self_


def table(title: str, counts: Counter, total: int, top: int) -> list[str]:
    out = [f"| {title} | share of samples |", "|---|---:|"]
    for (fn, file), n in counts.most_common(top):
        out.append(f"| `{fn}` ({file.split('site-packages/')[-1]}) | {n / total:.1%} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--under", default="", help="inclusive table: only functions whose file contains this")
    args = ap.parse_args(argv)
    with open(args.profile, encoding="utf-8", errors="replace") as f:
        total, inclusive, self_ = summarize(f, args.under)
    if not total:
        raise SystemExit(f"{args.profile}: no samples")
    print(f"{total} samples\n")
    print("\n".join(table("inclusive" + (f" (under {args.under})" if args.under else ""), inclusive, total, args.top)))
    print()
    print("\n".join(table("self", self_, total, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
