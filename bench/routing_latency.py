"""Routing decision latency: an 8,000-token prompt against 8 replicas x 100,000 indexed blocks.

Builds a ``unicache.router.cluster.index.LocalityIndex`` whose replicas each hold 100,000 block hashes:
replica i holds the first ``(i + 1) * L / R`` blocks of the request's L = 500-block
prompt (so every policy scans long matches, the expensive case) plus random filler.
Times ``policy.choose`` (and the lifecycle hooks the router calls per request) for every
registered policy and reports p50/p99 in microseconds, plus the ratio to ``round_robin``
measured in the same run. Target: p99 <= 1 ms for every policy.

Run: .venv/bin/python -m bench.routing_latency [--iters 2000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RoutingRequest
from unicache.router.routing.registry import make_routing_policy, routing_policy_names
from unicache.sim.metrics import percentile


def _rand_hashes(n: int) -> list[BlockHash]:
    return [BlockHash(os.urandom(16)) for _ in range(n)]


def build_state(replicas: int, blocks_per_replica: int, prompt_tokens: int, block_size: int):
    prompt = _rand_hashes(prompt_tokens // block_size)
    index = LocalityIndex()
    loads = []
    for i in range(replicas):
        rid = f"replica-{i}"
        held = prompt[: (i + 1) * len(prompt) // replicas]
        index.apply_summary(rid, epoch=1, seq=0, block_hashes=held + _rand_hashes(blocks_per_replica - len(held)))
        loads.append(ReplicaLoad(rid, running=4 + i % 3, waiting=i % 2, queued_prefill_tokens=512 * (i % 4),
                                 free_blocks=20_000, capacity_blocks=blocks_per_replica, in_flight=4 + i % 3))
    return prompt, index, loads


def time_policy(name: str, prompt, index, loads, iters: int, block_size: int) -> dict:
    policy = make_routing_policy(name)
    policy.update_replicas([r.replica_id for r in loads])
    if name == "sglang":
        # Give SGLang's trees the same contents the index has (its worst case too).
        for rid in index.replicas():
            policy.tree(rid).insert(list(index.holdings(rid).blocks), tick=0)
    samples = []
    for i in range(iters + 200):
        req = RoutingRequest(f"r{i}", RequestClass(session_id=f"s{i % 50}"), prompt, len(prompt) * block_size, block_size)
        t0 = time.perf_counter_ns()
        decision = policy.choose(req, loads, index)
        policy.on_request_routed(req, decision)
        policy.on_request_finished(req, decision.replica_id)
        dt = time.perf_counter_ns() - t0
        if i >= 200:
            samples.append(dt / 1000.0)
    samples.sort()
    return {"policy": name, "p50_us": percentile(samples, 50), "p99_us": percentile(samples, 99),
            "mean_us": sum(samples) / len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks-per-replica", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    prompt, index, loads = build_state(args.replicas, args.blocks_per_replica, args.prompt_tokens, args.block_size)

    # The bare index lookups every locality policy pays, for reference.
    samples = []
    rids = [r.replica_id for r in loads]
    for _ in range(args.iters):
        t0 = time.perf_counter_ns()
        index.match_all(rids, prompt)
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    samples.sort()
    rows = [{"policy": "(index.match_all)", "p50_us": percentile(samples, 50), "p99_us": percentile(samples, 99),
             "mean_us": sum(samples) / len(samples)}]
    rows += [time_policy(n, prompt, index, loads, args.iters, args.block_size) for n in routing_policy_names()]
    base = next(r for r in rows if r["policy"] == "round_robin")["p50_us"]
    print(f"{args.replicas} replicas x {args.blocks_per_replica} blocks, prompt {args.prompt_tokens} tokens "
          f"({len(prompt)} blocks), {args.iters} decisions each")
    print(f"{'policy':20s} {'p50 us':>9s} {'p99 us':>9s} {'p50/round_robin':>16s}")
    for r in rows:
        r["p50_ratio_to_round_robin"] = r["p50_us"] / base
        print(f"{r['policy']:20s} {r['p50_us']:9.1f} {r['p99_us']:9.1f} {r['p50_ratio_to_round_robin']:16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
