"""``unicache sim`` (replay a trace, compare eviction policies) and ``unicache gen-workload``."""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict, fields

from unicache.plumbing.errors import UsageError
from unicache.replica.eviction.registry import policy_names
from unicache.router.routing.cost_model import CostModel
from unicache.router.routing.registry import routing_policy_names
from unicache.sim.goodput import add_goodput, default_slo_s, lanes_unloaded_ttft_s, unloaded_median_ttft_s
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs, run_grid
from unicache.sim.steps import DEFAULT_STEP_TOKEN_BUDGET, StepReplay, unloaded_ttft_s
from unicache.sim.timing import DEFAULT_H2D_BYTES_PER_S, DEFAULT_MODEL_PRESET, KV_BYTES_PER_TOKEN, TimingModel, kv_bytes_per_token
from unicache.sim.trace import TraceError, read_trace, write_trace
from unicache.sim.workload import WorkloadConfig, generate

DEFAULT_POLICIES = "lru,radix-lru,unicache,opt"
DEFAULT_FRACS = "0.02,0.05,0.1,0.25"


def register(subparsers) -> None:
    sim = subparsers.add_parser("sim", help="replay a trace through simulated replicas and compare eviction policies")
    sim.add_argument("--trace", required=True, help="JSON Lines trace (docs/trace-format.md); one ships: "
                     "traces/mooncake-conversation-slice.jsonl (with --block-size 512)")
    sim.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16; Mooncake: 512)")
    cap = sim.add_mutually_exclusive_group()
    cap.add_argument("--capacity-frac", help=f"comma list of capacities as fractions of unique blocks (default {DEFAULT_FRACS})")
    cap.add_argument("--capacity-blocks", help="comma list of capacities in blocks (per replica)")
    host = sim.add_mutually_exclusive_group()
    host.add_argument("--host-capacity-frac",
                      help="comma list of host-tier sizes per replica as fractions of unique blocks (default: no host tier)")
    host.add_argument("--host-capacity-blocks", help="comma list of host-tier sizes per replica in blocks (0: none)")
    sim.add_argument("--host-eviction-policy", default="unicache",
                     help="the host tier's eviction policy (default unicache: the GPU UniCache's demotion "
                          "order, per class queue; lru is vLLM's and LMCache's)")
    sim.add_argument("--model-preset", default=DEFAULT_MODEL_PRESET,
                     help=f"KV bytes per token of this model ({', '.join(KV_BYTES_PER_TOKEN)}; default {DEFAULT_MODEL_PRESET})")
    sim.add_argument("--h2d-gbps", type=float, default=DEFAULT_H2D_BYTES_PER_S / 1e9,
                     help=f"host-to-device GB/s a promotion copies at (default {DEFAULT_H2D_BYTES_PER_S / 1e9:g})")
    sim.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma list of eviction policies (default {DEFAULT_POLICIES})")
    sim.add_argument("--json", dest="json_out", help="write the results here")
    sim.add_argument("--plot", help="draw hit ratio against capacity into this PNG")
    sim.add_argument("--rate-scale", default="1",
                     help="comma list of arrival-rate factors; each replays the trace with arrival times divided by it (default 1)")
    sim.add_argument("--goodput-slo-s",
                     help="TTFT p90 SLO in seconds, or 'auto' (3 x the unloaded TTFT of the median request): adds "
                          "goodput_rate_scale per (router, policy, capacity) over the --rate-scale points")
    sim.add_argument("--plot-ttft", help="draw TTFT p90 against rate scale, one line per router and policy, into this PNG")
    sim.add_argument("--ignore-labels", action="store_true", help="infer classes even where the trace has labels, and score the inference")
    sim.add_argument("--replicas", type=int, default=1, help="simulated replicas (default 1)")
    sim.add_argument("--router", default="round_robin", help="comma list of routing policies used with --replicas > 1")
    sim.add_argument("--pooled", action="store_true", help="also run one replica holding replicas x capacity")
    sim.add_argument("--index-flush-s", type=float, default=0.0,
                     help="with --replicas > 1: the replicas' event publishing period, so the router's index lags "
                          "their caches as a live one does (default 0: it never lags; the live publisher's is 0.05)")
    sim.add_argument("--service", choices=("lanes", "steps"), default="lanes",
                     help="service model: independent prefill lanes (default) or one engine stepping through "
                          "a shared token budget, as vLLM schedules (unicache.sim.steps; as fast as --lanes lanes)")
    sim.add_argument("--step-token-budget", type=int, default=DEFAULT_STEP_TOKEN_BUDGET,
                     help=f"with --service steps: tokens one engine step schedules (default {DEFAULT_STEP_TOKEN_BUDGET})")
    sim.add_argument("--lanes", type=int, default=4, help="concurrent prefill batches per replica (default 4)")
    sim.add_argument("--max-batch-requests", type=int, default=8, help="requests per prefill batch (default 8)")
    sim.add_argument("--max-batch-tokens", type=int, default=16384, help="uncached tokens that close a prefill batch (default 16384)")
    t = TimingModel()
    sim.add_argument("--prefill-coef", type=float, default=t.prefill_coef, help=f"prefill model coefficient (default {t.prefill_coef})")
    sim.add_argument("--batch-exp", type=float, default=t.batch_exp, help=f"prefill model batch exponent (default {t.batch_exp})")
    sim.add_argument("--token-exp", type=float, default=t.token_exp, help=f"prefill model token exponent (default {t.token_exp})")
    sim.add_argument("--decode-s-per-token", type=float, default=t.decode_s_per_token, help=f"seconds per output token (default {t.decode_s_per_token})")
    sim.add_argument("--calibration",
                     help="a backend cost calibration (the router's GET /v1/cluster/costs, or the live A/B's): the simulated "
                          "replicas' prefill and decode times follow its mean fitted costs, and routing policies price "
                          "decisions with it (its backends assigned to r0, r1, ... in order); replaces --prefill-coef etc.")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.set_defaults(func=run_sim)

    gen = subparsers.add_parser("gen-workload", help="write a seeded, labelled heterogeneous trace")
    gen.add_argument("--out", required=True, help="output JSON Lines path")
    for f in fields(WorkloadConfig):
        gen.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
            help=f"{f.metadata['help']} (default {f.default})",
        )
    gen.set_defaults(func=run_gen)


def _split(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UsageError(f"{what}: empty list")
    return items


def _numbers(text: str, what: str, kind: type, noun: str = "capacity") -> list:
    out = []
    for item in _split(text, what):
        try:
            value = kind(item)
        except ValueError:
            raise UsageError(f"{what}: {item!r} is not a number") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise UsageError(f"{what}: {noun} must be positive, got {item}")
        out.append(value)
    return out


def _counts(text: str, what: str) -> list[int]:
    """Comma list of block counts, 0 allowed (no host tier)."""
    out = []
    for item in _split(text, what):
        try:
            value = int(item)
        except ValueError:
            raise UsageError(f"{what}: {item!r} is not a whole number") from None
        if value < 0:
            raise UsageError(f"{what}: blocks must not be negative, got {item}")
        out.append(value)
    return out


def _check_names(names: list[str], known: list[str], flag: str, noun: str) -> None:
    for name in names:
        if name not in known:
            raise UsageError(f"{flag}: unknown {noun} {name!r} (choose from {', '.join(known)})")


def run_sim(args: argparse.Namespace) -> int:
    policies = _split(args.policies, "--policies")
    _check_names(policies, policy_names(), "--policies", "policy")
    if args.block_size <= 0:
        raise UsageError(f"--block-size must be positive, got {args.block_size}")
    if args.replicas <= 0:
        raise UsageError(f"--replicas must be positive, got {args.replicas}")
    if args.lanes <= 0 or args.max_batch_requests <= 0:
        raise UsageError("--lanes and --max-batch-requests must be positive")
    if args.step_token_budget <= 0:
        raise UsageError(f"--step-token-budget must be positive, got {args.step_token_budget}")
    if args.service == "steps" and (args.host_capacity_blocks is not None or args.host_capacity_frac is not None):
        raise UsageError("--service steps has no host tier: drop --host-capacity-blocks / --host-capacity-frac")
    if not args.index_flush_s >= 0:
        raise UsageError(f"--index-flush-s must not be negative, got {args.index_flush_s}")
    routers: list[str | None] = [None]
    if args.replicas > 1:
        routers = list(_split(args.router, "--router"))
        _check_names(routers, routing_policy_names(), "--router", "router")
    fracs = blocks = None
    if args.capacity_blocks is not None:
        blocks = _numbers(args.capacity_blocks, "--capacity-blocks", int)
    else:
        fracs = _numbers(args.capacity_frac or DEFAULT_FRACS, "--capacity-frac", float)
    rate_scales = _numbers(args.rate_scale, "--rate-scale", float, noun="rate scale")
    if len(set(rate_scales)) != len(rate_scales):
        raise UsageError(f"--rate-scale: repeated value in {args.rate_scale!r}")
    slo_s = None
    if args.goodput_slo_s is not None and args.goodput_slo_s != "auto":
        slo_s = _numbers(args.goodput_slo_s, "--goodput-slo-s", float, noun="SLO")
        if len(slo_s) != 1:
            raise UsageError("--goodput-slo-s: one value (seconds) or 'auto'")
        slo_s = slo_s[0]
    _check_names([args.host_eviction_policy], policy_names(), "--host-eviction-policy", "policy")
    host_capacities, host_fracs = [0], None
    if args.host_capacity_blocks is not None:
        host_capacities = _counts(args.host_capacity_blocks, "--host-capacity-blocks")
    elif args.host_capacity_frac is not None:
        host_fracs = _numbers(args.host_capacity_frac, "--host-capacity-frac", float)
    calibration = None
    try:
        if args.calibration:
            calibration = CostModel.from_calibration(args.calibration)
            if calibration.uniform:
                raise ValueError(f"calibration {args.calibration} lists no backend")
            timing = TimingModel.from_costs(calibration.mean_costs(), batch=args.max_batch_requests,
                                            h2d_bytes_per_s=args.h2d_gbps * 1e9,
                                            kv_bytes_per_token=kv_bytes_per_token(args.model_preset))
        else:
            timing = TimingModel(args.prefill_coef, args.batch_exp, args.token_exp, args.decode_s_per_token,
                                 h2d_bytes_per_s=args.h2d_gbps * 1e9, kv_bytes_per_token=kv_bytes_per_token(args.model_preset))
    except ValueError as exc:
        raise UsageError(f"--calibration: {exc}" if args.calibration else str(exc)) from None
    try:
        trace = prepare(read_trace(args.trace), args.block_size, ignore_labels=args.ignore_labels)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    try:
        capacities = blocks if blocks is not None else capacities_from_fracs(fracs, trace.unique_blocks)
    except ValueError as exc:
        raise UsageError(f"--capacity-frac: {exc}") from None
    if host_fracs is not None:
        host_capacities = [int(f * trace.unique_blocks) for f in host_fracs]
    base = ReplayConfig(
        policy=policies[0], capacity_blocks=capacities[0], replicas=args.replicas, lanes=args.lanes,
        max_batch_requests=args.max_batch_requests, max_batch_tokens=args.max_batch_tokens, timing=timing,
        host_policy=args.host_eviction_policy, index_flush_s=args.index_flush_s, cost_model=calibration,
    )
    print(
        f"trace {args.trace}: {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, "
        f"{trace.block_accesses} block accesses, block size {args.block_size}"
        + (" (labels ignored)" if args.ignore_labels else "")
    )
    multi = args.replicas > 1
    print(_header(multi))
    results = run_grid(
        trace, policies, capacities, base, routers=routers, pooled=args.pooled and multi,
        progress=not args.no_progress, on_result=lambda r: print(_row(r, trace.unique_blocks, multi), flush=True),
        rate_scales=rate_scales, host_capacities=host_capacities,
        replay=functools.partial(StepReplay, step_token_budget=args.step_token_budget) if args.service == "steps" else Replay,
    )
    # the auto SLO's base: on the step model the light-load TTFT (a decode step in flight)
    unloaded = lanes_unloaded_ttft_s if args.service == "lanes" else functools.partial(
        unloaded_ttft_s, lanes=args.lanes, step_token_budget=args.step_token_budget, decoding=True)
    goodput_rows = None
    if args.goodput_slo_s is not None:
        if slo_s is None:
            slo_s = default_slo_s(trace, timing, unloaded_ttft=unloaded)
        goodput_rows = add_goodput(results, slo_s)
        for g in goodput_rows:
            who = g["policy"] + (f" / {g['router']}" if "router" in g else "")
            print(f"goodput {who} @ {g['capacity_blocks']} blocks: rate scale {g['goodput_rate_scale']:.3f}"
                  + (" (every scale passed: a lower bound)" if g["goodput_saturated"] else "")
                  + f" (TTFT p90 SLO {slo_s:.4f} s)")
    if fracs is not None:
        for r in results:
            r["capacity_frac"] = fracs[capacities.index(r["capacity_blocks"])]
    if trace.classifier_accuracy:
        acc = trace.classifier_accuracy
        print("classifier accuracy vs labels: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items() if k != "labelled_requests"))
    report = {
        "trace": str(args.trace),
        "block_size": args.block_size,
        "requests": len(trace.requests),
        "unique_blocks": trace.unique_blocks,
        "block_accesses": trace.block_accesses,
        "labelled": trace.labelled,
        "ignore_labels": args.ignore_labels,
        "timing": asdict(timing),
        "lanes": args.lanes,
        "service": args.service,
        "rate_scales": rate_scales,
        "unloaded_median_ttft_s": unloaded_median_ttft_s(trace, timing, unloaded),
        "results": results,
    }
    if goodput_rows is not None:
        report["goodput_slo_s"] = slo_s
        report["goodput"] = goodput_rows
    if trace.classifier_accuracy is not None:
        report["classifier_accuracy"] = trace.classifier_accuracy
    if args.json_out:
        _write(args.json_out, lambda fh: json.dump(report, fh, indent=2))
    if args.plot:
        from unicache.sim.plot import plot_hit_ratio

        try:
            plot_hit_ratio(results, trace.unique_blocks, args.plot, title=str(args.trace))
        except OSError as exc:
            raise UsageError(f"--plot: cannot write {args.plot} ({exc.strerror})") from None
    if args.plot_ttft:
        from unicache.sim.plot import plot_ttft_vs_rate

        try:
            plot_ttft_vs_rate(results, args.plot_ttft, slo_s=slo_s, title=str(args.trace))
        except OSError as exc:
            raise UsageError(f"--plot-ttft: cannot write {args.plot_ttft} ({exc.strerror})") from None
    return 0


def _write(path: str, dump) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            dump(fh)
    except OSError as exc:
        raise UsageError(f"cannot write {path} ({exc.strerror})") from None


def _header(multi: bool) -> str:
    cols = f"{'policy':<10} {'capacity':>9} {'cap%':>6} {'host':>8}"
    if multi:
        cols += f" {'router':<16} {'imbal':>6}"
    return cols + (f" {'hit%':>6} {'host%':>6} {'tok%':>6} {'ttft_mean':>9} {'ttft_p90':>9} {'ttft_p99':>9}"
                   f" {'evictions':>9} {'acc/s':>9} {'rate':>5}")


def _row(r: dict, unique_blocks: int, multi: bool) -> str:
    row = (f"{r['policy']:<10} {r['capacity_blocks']:>9} {100.0 * r['capacity_blocks'] / unique_blocks:>6.2f}"
           f" {r['host_capacity_blocks']:>8}")
    if multi:
        row += f" {r.get('router', '-'):<16} {r.get('load_imbalance', 1.0):>6.2f}"
    return row + (
        f" {100 * r['block_hit_ratio']:>6.2f} {100 * r['host_hit_ratio']:>6.2f} {100 * r['token_hit_ratio']:>6.2f}"
        f" {r['ttft_mean_s']:>9.3f} {r['ttft_p90_s']:>9.3f} {r['ttft_p99_s']:>9.3f} {r['evictions']:>9}"
        f" {r['accesses_per_s']:>9.0f} {r['rate_scale']:>5g}"
    )


def run_gen(args: argparse.Namespace) -> int:
    values = {f.name: getattr(args, f.name) for f in fields(WorkloadConfig)}
    try:
        cfg = WorkloadConfig(**values)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    records = generate(cfg)
    _write(args.out, lambda fh: None)  # fail early and cleanly on an unwritable path
    write_trace(args.out, records)
    accesses = sum(len(r["hash_ids"]) for r in records)
    print(f"wrote {len(records)} requests ({accesses} block accesses, block size {cfg.block_size}) to {args.out}")
    return 0
