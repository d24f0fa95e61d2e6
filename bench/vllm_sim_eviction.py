"""Eviction policies on the simulator's model of vLLM (``unicache.sim.vllm_replay``): the
hit-ratio tables of docs/eviction.md, and the tuning runs that chose UniCache's defaults.

Each run replays a trace one request at a time through a modelled vLLM server (null
block, tail-first release, decode blocks cached, hits counted as
``vllm:prefix_cache_hits_total`` counts them: prompt tokens, at most prompt - 1) with a
pool of a share of the trace's unique full prompt blocks. Hit ratio, % of prompt tokens.

    report: Mooncake requests 1,500 onward (classes inferred) and the generated mix
            (seed 0, 1,200 s; labelled and labels hidden), every policy, 2/5/10/25%;
    tune:   UniCache with one knob changed at a time (``--variant NAME=JSON``) against
            the default, on tuning data only: Mooncake requests 0-1,499, mix seeds 100 and
            101, one trace per generator family at the suite's tuning point and seed.

    python -m bench.vllm_sim_eviction report --out bench/results/vllm_sim_eviction.md
    python -m bench.vllm_sim_eviction tune --variant 'margin01={"guard_margin":0.01}' ...
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from unicache.sim.prepare import PreparedTrace, prepare
from unicache.sim.suite import GENERATED_FAMILIES, draw_config
from unicache.sim.trace import TraceRequest, parse_trace_line, read_trace
from unicache.sim.vllm_replay import VllmReplay, VllmServerModel
from unicache.sim.workload import WorkloadConfig, generate
from bench.paths import mooncake_trace

POLICIES = ("lru", "fifo", "lfu", "arc", "s3fifo", "lecar", "radix-lru", "unicache")
FRACS = (0.02, 0.05, 0.1, 0.25)
MOONCAKE_TUNE = 1500  # Mooncake requests [0, 1500) tune; the report starts after them


@dataclass(slots=True)
class Case:
    name: str
    trace: PreparedTrace
    unique: int


def _rows(rows: list[dict]) -> list[TraceRequest]:
    return [parse_trace_line(json.dumps(r), "gen", i + 1, i) for i, r in enumerate(rows)]


def case(name: str, trace: list[TraceRequest], block_size: int, hidden: bool) -> Case:
    pt = prepare(trace, block_size, ignore_labels=hidden)
    unique = len({h for r in pt.requests for h in r.prompt_hashes[: r.input_length // block_size]})
    return Case(name, pt, unique)


def hit_ratio(c: Case, policy: str, frac: float, kwargs: dict | None = None) -> float:
    bs = c.trace.block_size
    longest = max(-(-(r.input_length + r.output_length) // bs) for r in c.trace.requests)
    blocks = max(int(frac * c.unique), longest + 1)
    return VllmReplay(c.trace, policy, VllmServerModel(num_gpu_blocks=blocks + 1), kwargs).run().hit_ratio


def report_cases(mooncake: str) -> list[Case]:
    moon = read_trace(mooncake)[MOONCAKE_TUNE:]
    mix = _rows(generate(WorkloadConfig(seed=0, duration=1200.0)))
    return [case(f"Mooncake requests {MOONCAKE_TUNE:,}+ (block 512, classes inferred)", moon, 512, True),
            case("generated mix (block 16, labelled)", mix, 16, False),
            case("generated mix, labels hidden", mix, 16, True)]


def tune_cases(mooncake: str) -> list[Case]:
    out = [case("mooncake tune", read_trace(mooncake)[:MOONCAKE_TUNE], 512, True)]
    for seed in (100, 101):
        mix = _rows(generate(WorkloadConfig(seed=seed, duration=600.0)))
        out += [case(f"mix{seed}", mix, 16, False), case(f"mix{seed} hidden", mix, 16, True)]
    for fam in GENERATED_FAMILIES:
        out.append(case(f"{fam} tune", _rows(generate(draw_config(fam, 1000, 1000, duration=600.0))), 16, False))
    return out


def run_report(args) -> str:
    lines = ["# Eviction on the simulator's model of vLLM", "",
             f"`python -m bench.vllm_sim_eviction report` ({time.strftime('%Y-%m-%d')}). Hit ratio, % of prompt tokens "
             "(vLLM's `prefix_cache_hits / queries`); pool: share of the trace's unique full prompt blocks; "
             "one request at a time.", "",
             "| trace | pool | " + " | ".join(args.policies) + " | best classic | unicache - lru |",
             "|---|---|" + "---|" * (len(args.policies) + 2)]
    for c in report_cases(args.mooncake):
        for f in args.fracs:
            r = {p: 100 * hit_ratio(c, p, f) for p in args.policies}
            classic = {p: v for p, v in r.items() if p not in ("unicache", "lru")}
            best = max(classic, key=classic.get) if classic else ""
            line = (f"| {c.name} | {f:.0%} | " + " | ".join(f"{r[p]:.2f}" for p in args.policies)
                    + f" | {best} {classic.get(best, float('nan')):.2f} | {r.get('unicache', 0) - r.get('lru', 0):+.2f} |")
            print(line, flush=True)
            lines.append(line)
    return "\n".join(lines) + "\n"


def run_tune(args) -> str:
    variants = {"default": {}, "unguarded": {"recency_guard": False}}
    for v in args.variant:
        name, _, spec = v.partition("=")
        variants[name] = json.loads(spec)
    lines = ["# UniCache defaults on the simulator's model of vLLM (tuning data only)", "",
             "Hit ratio, %; lru beside; one knob changed at a time.", "",
             "| trace | pool | lru | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    sums = {k: 0.0 for k in variants}
    for c in tune_cases(args.mooncake):
        if args.only and not any(word in c.name for word in args.only):
            continue
        for f in args.fracs:
            lru = 100 * hit_ratio(c, "lru", f)
            r = {k: 100 * hit_ratio(c, "unicache", f, kw) for k, kw in variants.items()}
            for k in r:
                sums[k] += r[k] - lru
            line = f"| {c.name} | {f:.0%} | {lru:.2f} | " + " | ".join(f"{r[k]:.2f}" for k in variants) + " |"
            print(line, flush=True)
            lines.append(line)
    lines.append("| sum of (unicache - lru) | | | " + " | ".join(f"{sums[k]:+.2f}" for k in variants) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("report", "tune"))
    p.add_argument("--mooncake", default=str(mooncake_trace()))
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--fracs", type=float, nargs="+", default=list(FRACS))
    p.add_argument("--variant", action="append", default=[], help="tune: NAME=JSON of UniCachePolicy keywords")
    p.add_argument("--only", nargs="*", default=[], help="tune: the tuning traces whose name contains one of these")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    text = run_report(args) if args.mode == "report" else run_tune(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
