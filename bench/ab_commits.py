"""A/B of two commits on one benchmark, in one run: each commit in its own git worktree
and virtual environment, the benchmark run alternately in each (the order turning every
round), and the chosen JSON figures compared per round.

Both sides run their own tree entirely (the benchmark's code, the router, the replicas,
fake or real), which ``--baseline-unicache`` of the benchmarks cannot do (it swaps only
the router). A side's venv holds only its own editable install; the dependencies come
from this interpreter's site-packages (a ``.pth`` line), so setting one up takes seconds
and both sides import the same library versions.

    .venv/bin/python -m bench.ab_commits --base REV [--head REV] [--rounds 3]
        --field median.router_hop.cpu_ms_per_request [--field ...] [--json OUT] [--md OUT]
        -- python -m bench.router_profile ... --json {out}

In the command, ``python`` is replaced by the side's interpreter and ``{out}`` by the path
the benchmark writes its JSON to; it runs in the side's worktree. ``--copy PATH`` (repeatable)
copies that file of the head's tree into the base's before the rounds, so both sides run
the same benchmark code (a benchmark newer than the base, or one changed since). Reported per field: each
round's head / base ratio, the median of those ratios, and both sides' medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.paths import REPO
from bench.report_files import git_commit
from bench.rounds import round_order


def resolve(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def make_side(root: Path, name: str, commit: str) -> Path:
    """A worktree of ``commit`` under ``root`` with a venv whose only own package is its
    editable install; returns its interpreter."""
    tree = root / name
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tree / ".venv")], check=True)
    python = tree / ".venv" / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    # NOTE: paths added by a .pth are not site dirs, so this venv's .pth files (its own
    # editable finder) are read and those of the shared site-packages (ours) are not; pip
    # comes from there too and installs into this venv (its build gets its own setuptools).
    Path(own, "_ab_shared_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)],
                   check=True, capture_output=True)
    return python


def dig(data: dict, dotted: str) -> float:
    for part in dotted.split("."):
        data = data[part]
    return float(data)


def run_side(python: Path, cwd: Path, command: list[str], out: Path) -> dict:
    cmd = [str(python) if c == "python" else c.replace("{out}", str(out)) for c in command]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {cwd} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"    {cwd.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def compare(rounds: list[dict[str, dict]], fields: list[str]) -> dict:
    out = {}
    for f in fields:
        base = [dig(r["base"], f) for r in rounds]
        head = [dig(r["head"], f) for r in rounds]
        ratios = [h / b for h, b in zip(head, base)]
        out[f] = {"base": base, "head": head, "ratios": ratios, "median_ratio": statistics.median(ratios),
                  "base_median": statistics.median(base), "head_median": statistics.median(head),
                  "head_lower_in": sum(r < 1 for r in ratios)}
    return out


def markdown(report: dict) -> str:
    lines = [f"# A/B: {report['base']} (base) against {report['head']} (head)\n",
             f"Produced by `{report['command']}` at commit {report['commit']}, {report['rounds']} rounds "
             f"(order turning each round), {report['wall_s'] / 60:.1f} min wall.\n",
             "| figure | base median | head median | head / base per round | median ratio |",
             "|---|---|---|---|---|"]
    for f, v in report["fields"].items():
        lines.append(f"| {f} | {v['base_median']:.4g} | {v['head_median']:.4g} | "
                     + ", ".join(f"{r:.3f}" for r in v["ratios"]) + f" | {v['median_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        sys.exit("usage: see the module docstring (the benchmark command follows --)")
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--field", action="append", required=True, help="dotted path of a number in the benchmark's JSON")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--copy", action="append", default=[], metavar="PATH",
                    help="a file (relative to the repository) copied from the head's tree into the base's")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command or "{out}" not in " ".join(command):
        ap.error("the command after -- must write its JSON to {out}")
    t0 = time.perf_counter()
    sides = {"base": resolve(args.base), "head": resolve(args.head)}
    root = Path(tempfile.mkdtemp(prefix="ab_commits_"))
    try:
        pythons = {}
        for name, commit in sides.items():
            print(f"setting up {name} at {commit[:10]}", file=sys.stderr, flush=True)
            pythons[name] = make_side(root, name, commit)
        for rel in args.copy:
            dest = root / "base" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / "head" / rel, dest)
        rounds = []
        for i in range(args.rounds):
            order = round_order(("base", "head"), i)
            print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}", file=sys.stderr, flush=True)
            rounds.append({name: run_side(pythons[name], root / name, command, root / f"{name}_{i}.json") for name in order})
    finally:
        for name in sides:
            subprocess.run(["git", "worktree", "remove", "--force", str(root / name)], cwd=REPO, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "command": "python -m bench.ab_commits " + " ".join(argv),
        "commit": git_commit(REPO), "base": sides["base"][:10], "head": sides["head"][:10],
        "rounds": args.rounds, "fields": compare(rounds, args.field), "wall_s": time.perf_counter() - t0,
        "raw": rounds,
    }
    for f, v in report["fields"].items():
        print(f"{f}: base {v['base_median']:.4g}, head {v['head_median']:.4g}, head/base per round "
              + ", ".join(f"{r:.3f}" for r in v["ratios"]) + f" (median {v['median_ratio']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
