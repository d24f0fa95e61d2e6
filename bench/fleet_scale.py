"""A simulated fleet (issue 17): routing decision cost by fleet size, index bytes per
(block, replica) entry, and Redis event bandwidth per replica.

Decision cost. For each fleet size R (default 8, 64, 256, 1,024) a ``LocalityIndex`` holds
``--blocks`` distinct block hashes (default 100,000): the request's 500-block prompt,
whose first (i + 1) * 500 / 8 blocks replica i of the first 8 holds (long matches, the
expensive case, and the same 8 holders at every R), plus filler chains of 50 blocks, each
on ``--copies`` replicas (default 2) spread over the fleet. Every replica reports a load,
and for ``cache_aware`` holds a churn inflow and a session footprint (one earlier session
turn routed to each: a busy fleet's steady state, whose terms decay at every request).
Timed per decision: ``policy.choose`` plus the ``on_request_routed`` and
``on_request_finished`` hooks the router calls, for requests without a session (the full
cost path: no session-home shortcut; ``--queue-shares``: ``cache_aware`` scales every
queue by a share, as if other routers' requests waited everywhere). p50/p99 per policy and
R, the ratio of each p50 to
``round_robin``'s at the same R (measured in the same run), ``cache_aware`` also for a
500-block prompt no replica holds (every replica a candidate: the full pass over the
fleet's loads, which a prompt whose holders are clearly fastest skips), and for the held
prompt labelled a template (its first ``TEMPLATE_BLOCKS`` blocks; the template home is the
hash ring's owner of its key), and the index work alone:
``prefix_matches`` (the hash -> replicas walk) against ``match`` per replica. For the
prompt no replica holds, its phases alone too (``time_cold_phases``: the walk, TTFT
admission, fit-first's room filter over the whole fleet; the cost loop over the admissible
replicas is the rest). Above 32 replicas ``cache_aware`` weighs the replicas that could hit
the prompt, the least-queued one and a moving window of 32 others
(``router/routing/cache_aware/candidates.py``); the rows
``cache_aware:candidate_window=0`` time the same two prompts with every replica weighed.
Last, every replica is also given the prompt's first block (a system prompt the whole
fleet holds) and both settings are timed on the held prompt and on a prompt that shares
only that block with anything indexed; then 8 other replicas also hold the rest of that
second prompt in their host tiers, and both settings are timed on it again.

Memory. ``tracemalloc`` around building the index: bytes per (block, replica) entry.

Event bandwidth. The simulator replays a trace (default: the Mooncake trace's first
``--bw-requests`` requests at ``--bw-replicas`` replicas, cache_aware + unicache) and
folds each replica's store events into one ``KVEventBatch`` per 50 ms of simulated time,
exactly as the publisher does (``PendingBatch``), then seals it as Redis receives it.
Reported: bytes per second per replica, with and without ``stored_parents`` (the cost of
the parent hashes the index trims with).

Run: .venv/bin/python -m bench.fleet_scale [--fleets 8,64,256,1024] [--iters 2000] [--policies cache_aware,cache_aware:fit_first=false]
     [--out-dir bench/results]   (writes fleet_scale.{json,md,png})
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

from tqdm import tqdm

from unicache.contract.block_hash import BlockHash
from unicache.contract.redis_keys import EVENT_FLUSH_INTERVAL_S
from unicache.contract.request_class import RequestClass
from unicache.router.cluster.index import LocalityIndex
from unicache.router.routing.base import ReplicaLoad, RouteDecision, RoutingRequest, SharesRouterState
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
from unicache.router.routing.registry import make_routing_policy
from unicache.sim.metrics import percentile
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import git_commit, save_figure, write_report

PROMPT_BLOCKS = 500
HOLDERS = 8
TEMPLATE_BLOCKS = 4  # a template request's template: the prompt's first blocks
FILLER_CHAIN = 50
BLOCK_SIZE = 16
# cache_aware weighing every replica, as before its candidate window (router/routing/cache_aware/candidates.py)
FULL_PASS = "cache_aware:candidate_window=0"


def _hashes(rng: random.Random, n: int) -> list[BlockHash]:
    return [BlockHash(rng.randbytes(16)) for _ in range(n)]


def _parents(chain: list[BlockHash]) -> list[BlockHash | None]:
    return [None, *chain[:-1]]


def build_index(replicas: int, blocks: int, copies: int, seed: int = 0):
    """The index of the module docstring; returns (prompt, index, loads, entries)."""
    rng = random.Random(seed)
    prompt = _hashes(rng, PROMPT_BLOCKS)
    index = LocalityIndex()
    rids = [f"replica-{i}" for i in range(replicas)]
    held: dict[str, tuple[list, list]] = {r: ([], []) for r in rids}
    for i in range(min(HOLDERS, replicas)):
        part = prompt[: (i + 1) * PROMPT_BLOCKS // HOLDERS]
        held[rids[i]][0].extend(part)
        held[rids[i]][1].extend(_parents(part))
    left = blocks - PROMPT_BLOCKS
    k = 0
    while left > 0:
        chain = _hashes(rng, min(FILLER_CHAIN, left))
        left -= len(chain)
        for c in range(min(copies, replicas)):
            hs, ps = held[rids[(k + c * 7919) % replicas]]
            hs.extend(chain)
            ps.extend(_parents(chain))
        k += 1
    for rid in rids:
        hs, ps = held[rid]
        index.apply_summary(rid, 1, 0, hs, ps)
    loads = [
        ReplicaLoad(rid, running=4 + i % 3, waiting=i % 2, queued_prefill_tokens=512 * (i % 4), free_blocks=20_000,
                    capacity_blocks=100_000, in_flight=4 + i % 3)
        for i, rid in enumerate(rids)
    ]
    return prompt, index, loads


def _summary(samples_us: list[float]) -> dict:
    s = sorted(samples_us)
    return {"p50_us": round(percentile(s, 50), 2), "p99_us": round(percentile(s, 99), 2), "mean_us": round(sum(s) / len(s), 2)}


def _timed(step, iters: int, warmup: int = 200) -> dict:
    """``step(i)`` timed ``iters`` times after ``warmup``: CPU time of this thread (what a
    decision costs; on a shared machine wall-clock p99 mostly measures preemption) and
    wall clock, p50/p99/mean in µs."""
    # NOTE: the index's objects are long-lived; frozen, no collection walks them while
    # decisions are timed. The router does not freeze its heap: CPython collects the oldest
    # generation only once the objects promoted since the last such collection exceed a
    # quarter of the long-lived ones, rare once a router's index is built, and that pause
    # (tens of ms over millions of index objects) is not in these figures.
    gc.collect()
    gc.freeze()
    cpu, wall = [], []
    for i in range(iters + warmup):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        step(i)
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        if i >= warmup:
            cpu.append((c1 - c0) / 1000.0)
            wall.append((t1 - t0) / 1000.0)
    gc.unfreeze()
    out = _summary(cpu)
    out.update({f"wall_{k}": v for k, v in _summary(wall).items()})
    return out


def policy_spec(spec: str) -> tuple[str, dict]:
    """A ``--policies`` entry: a registry name, or ``name:key=value&key=value`` with JSON
    values (``cache_aware:fit_first=false``) to time a setting other than the default."""
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split("&")):
        key, _, value = item.partition("=")
        kwargs[key] = json.loads(value)
    return name, kwargs


def _policy(spec: str, index: LocalityIndex, loads, queue_shares: bool = False):
    name, kwargs = policy_spec(spec)
    policy = make_routing_policy(name, **kwargs)
    policy.update_replicas([r.replica_id for r in loads])
    if queue_shares and isinstance(policy, SharesRouterState):
        # every replica with a queue holds other routers' waiting requests, a quarter of
        # their tokens uncached: a queue share for each (the worst case for its lookups)
        policy.set_peer_queued({r.replica_id: (r.queued_prefill_tokens // 4, r.queued_prefill_tokens)
                                for r in loads if r.queued_prefill_tokens})
    if name == "sglang":
        # SGLang's own approximate trees get the index's contents (its worst case too).
        for rid in index.replicas():
            policy.tree(rid).insert(list(index.holdings(rid).blocks), tick=0)
    return policy


def _busy_terms(policy, loads) -> None:
    """A busy fleet's steady state for ``cache_aware``: every replica has a churn inflow
    and a session footprint (one earlier session turn routed to each), so the terms cost
    what they cost in production, not what an idle fleet's would. After the replicas are
    known: a policy forgets the terms of replicas it is told are gone."""
    if not isinstance(policy, CacheAwarePolicy):
        return
    for r in loads:
        rid = r.replica_id
        warm = RoutingRequest(f"warm-{rid}", RequestClass(session_id=f"warm-{rid}"),
                              [BlockHash(rid.encode().ljust(16, b"w"))], BLOCK_SIZE, BLOCK_SIZE)
        policy.on_request_routed(warm, RouteDecision(rid, "load"))
        policy.on_request_finished(warm, rid)


def time_policy(name: str, prompt, index, loads, iters: int, queue_shares: bool = False,
                cls: RequestClass | None = None) -> dict:
    policy = _policy(name, index, loads, queue_shares)
    _busy_terms(policy, loads)
    n_tokens = len(prompt) * BLOCK_SIZE
    cls = cls or RequestClass()

    def step(i: int) -> None:
        req = RoutingRequest(f"q{i}", cls, prompt, n_tokens, BLOCK_SIZE)
        decision = policy.choose(req, loads, index)
        policy.on_request_routed(req, decision)
        policy.on_request_finished(req, decision.replica_id)

    return _timed(step, iters)


def time_cold_phases(prompt, index, loads, iters: int, queue_shares: bool = False) -> dict:
    """Where ``cache_aware``'s decision for a prompt no replica holds goes: the index walk
    (``prefix_matches``), TTFT admission (``_admission``) and fit-first's room filter
    (``_fit``) timed alone, each ``iters`` times on the busy fleet's state that
    ``time_policy`` decides on; the cost loop is the rest of ``choose``."""
    policy = _policy("cache_aware", index, loads, queue_shares)
    _busy_terms(policy, loads)
    n_tokens = len(prompt) * BLOCK_SIZE
    matches = index.prefix_matches(prompt)
    admissible = policy._admission(loads, n_tokens, BLOCK_SIZE, matches)
    return {"walk": _timed(lambda i: index.prefix_matches(prompt), iters, warmup=50),
            "admission": _timed(lambda i: policy._admission(loads, n_tokens, BLOCK_SIZE, matches), iters, warmup=50),
            "room": _timed(lambda i: policy._fit(admissible, n_tokens, BLOCK_SIZE), iters, warmup=50),
            "admissible": len(admissible)}


def time_live(name: str, prompt, index, loads, iters: int, queue_shares: bool = False) -> dict:
    """The live router's choice: ``ClusterView.loads`` (replicas known from heartbeats)
    then the policy, with the in-flight bookkeeping around the request."""
    from unicache.router.cluster.view import ClusterView
    from unicache.v1 import cache_pb2, common_pb2

    policy = _policy(name, index, loads, queue_shares)
    cluster = ClusterView(policy, index)
    cluster.redis_connected = True
    for r in loads:
        cluster.upsert(r.replica_id, f"10.0.0.1:{r.replica_id}", cache_pb2.Heartbeat(
            replica_id=r.replica_id, running=r.running, waiting=r.waiting, queued_prefill_tokens=r.queued_prefill_tokens,
            cache=common_pb2.CacheState(replica_id=r.replica_id, free_blocks=r.free_blocks,
                                        capacity_blocks=r.capacity_blocks)))
    _busy_terms(policy, loads)
    n_tokens = len(prompt) * BLOCK_SIZE

    def step(i: int) -> None:
        req = RoutingRequest(f"q{i}", RequestClass(), prompt, n_tokens, BLOCK_SIZE)
        decision = policy.choose(req, cluster.loads(), cluster.locality())
        policy.on_request_routed(req, decision)
        cluster.started(decision.replica_id)
        cluster.finished(decision.replica_id)
        policy.on_request_finished(req, decision.replica_id)

    return _timed(step, iters)


def time_lookup(index: LocalityIndex, loads, prompt, iters: int) -> dict:
    """The index work alone: one hash -> replicas walk against ``match`` per replica."""
    rids = [r.replica_id for r in loads]
    return {"prefix_matches": _timed(lambda i: index.prefix_matches(prompt), iters, warmup=50),
            "match_per_replica": _timed(lambda i: index.match_all(rids, prompt), iters, warmup=50)}


def index_bytes(replicas: int, blocks: int, copies: int) -> dict:
    gc.collect()
    tracemalloc.start()
    prompt, index, loads = build_index(replicas, blocks, copies, seed=1)
    del prompt, loads
    gc.collect()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # NOTE: the traced bytes include the hash bytes objects themselves (33 bytes each,
    # shared by every replica holding the block), as a router receiving them keeps them.
    entries = index.num_entries()
    return {"replicas": replicas, "entries": entries, "hashes": index.num_hashes(), "bytes": current,
            "bytes_per_entry": round(current / entries, 1)}


def bandwidth(trace_path: Path, requests: int, replicas: int, capacity: int, block_size: int) -> dict:
    from unicache.replica.publishing.event_batch import PendingBatch
    from unicache.sim.prepare import prepare
    from unicache.sim.replay import Replay, ReplayConfig
    from unicache.sim.trace import read_trace
    from unicache.testing.signed_state import SIGNER

    class Recording(Replay):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.events: dict[str, list] = {}

        def _take_events(self, rep):
            events = rep.store.take_events()
            self.events.setdefault(rep.replica_id, []).extend(events)
            return events

    records = list(read_trace(trace_path))[:requests]
    trace = prepare(records, block_size)
    cfg = ReplayConfig(policy="unicache", capacity_blocks=capacity, replicas=replicas, router="cache_aware")
    sim = Recording(trace, cfg, progress=True)
    result = sim.run()
    for rep in sim.replicas:  # what is left after the last decision
        sim.events.setdefault(rep.replica_id, []).extend(rep.store.take_events())
    duration = max(r.arrival_s for r in trace.requests)
    totals = {"proto": 0, "sealed": 0, "proto_no_parents": 0, "batches": 0, "stored": 0, "removed": 0}
    for rid, events in sim.events.items():
        buckets: dict[int, PendingBatch] = {}
        for ev in events:
            buckets.setdefault(int(ev.timestamp // EVENT_FLUSH_INTERVAL_S), PendingBatch()).add([ev])
        for seq, key in enumerate(sorted(buckets), start=1):
            pb = buckets[key]
            if pb.empty():
                continue
            msg = pb.to_proto(rid, 1_700_000_000_000, seq, key * EVENT_FLUSH_INTERVAL_S)
            raw = msg.SerializeToString()
            totals["proto"] += len(raw)
            totals["sealed"] += len(SIGNER.seal("events", raw))
            del msg.stored_parents[:]
            totals["proto_no_parents"] += len(msg.SerializeToString())
            totals["batches"] += 1
            totals["stored"] += len(msg.stored)
            totals["removed"] += len(msg.removed)
    per = {k: round(v / duration / replicas, 1) for k, v in totals.items()}
    return {"trace": str(trace_path), "requests": len(trace.requests), "replicas": replicas,
            "capacity_blocks": capacity, "block_size": block_size, "sim_duration_s": round(duration, 1),
            "token_hit_ratio": result.get("token_hit_ratio"), "per_replica_per_s": per,
            "parents_overhead": round(totals["proto"] / max(1, totals["proto_no_parents"]), 3)}


def markdown(report: dict) -> str:
    lines = ["# Fleet scale: decision cost, index memory, event bandwidth", "",
             f"commit {report['commit']}; {report['config']['blocks']:,} indexed block hashes, "
             f"{report['config']['copies']} copies of each filler chain, a {PROMPT_BLOCKS}-block prompt held by "
             f"{HOLDERS} replicas; requests without a session; choose + hooks per decision.", "",
             "CPU time of the deciding thread (wall clock beside it: on a loaded machine its p99 is the "
             "scheduler's time slice, not the code).", "",
             "| replicas | entries | policy | CPU p50 µs | CPU p99 µs | wall p50 / p99 µs | p50 / round_robin |",
             "|---|---|---|---|---|---|---|"]
    for row in report["decisions"]:
        lines.append(f"| {row['replicas']} | {row['entries']:,} | {row['policy']} | {row['p50_us']} | {row['p99_us']} | "
                     f"{row['wall_p50_us']} / {row['wall_p99_us']} | {row['p50_ratio_to_round_robin']} |")
    lines += ["", "Index work alone (CPU):", "",
              "| replicas | prefix_matches p50 / p99 µs | match per replica p50 / p99 µs |", "|---|---|---|"]
    for row in report["lookups"]:
        w, m = row["prefix_matches"], row["match_per_replica"]
        lines.append(f"| {row['replicas']} | {w['p50_us']} / {w['p99_us']} | {m['p50_us']} / {m['p99_us']} |")
    lines += ["", "The decision for a prompt no replica holds with every replica weighed (candidate_window=0), "
              "by phase (CPU p50 / p99 µs; the cost loop and the hooks are the rest of that decision above):", "",
              "| replicas | index walk | TTFT admission | fit-first's room | admissible replicas |", "|---|---|---|---|---|"]
    for row in report.get("cold_phases", ()):
        w, a, r = row["walk"], row["admission"], row["room"]
        lines.append(f"| {row['replicas']} | {w['p50_us']} / {w['p99_us']} | {a['p50_us']} / {a['p99_us']} | "
                     f"{r['p50_us']} / {r['p99_us']} | {row['admissible']} |")
    mem = report["memory"]
    lines += ["", f"Index memory: {mem['bytes']:,} bytes for {mem['entries']:,} (block, replica) entries over "
              f"{mem['hashes']:,} hashes at {mem['replicas']} replicas = **{mem['bytes_per_entry']} bytes per entry** "
              "(tracemalloc)."]
    bw = report.get("bandwidth")
    if bw:
        p = bw["per_replica_per_s"]
        lines += ["", f"Event bandwidth ({bw['requests']} requests of {Path(bw['trace']).name}, {bw['replicas']} replicas "
                  f"x {bw['capacity_blocks']} blocks, block size {bw['block_size']}, {bw['sim_duration_s']} s simulated, "
                  f"one batch per replica per {int(EVENT_FLUSH_INTERVAL_S * 1000)} ms): per replica "
                  f"**{p['sealed']} B/s sealed** ({p['proto']} B/s protobuf, {p['proto_no_parents']} B/s without "
                  f"stored_parents: x{bw['parents_overhead']}), {p['batches']} batches/s, {p['stored']} stored and "
                  f"{p['removed']} removed blocks/s."]
    return "\n".join(lines) + "\n"


# cache_aware's prompt kinds in the decision rows: (label suffix of the shipped row, of the
# row weighing every replica, legend name)
HOST_RUNS = "(only the first block on every replica, the rest on 8 replicas' host tiers)"
PROMPT_KINDS = (
    ("", " (the held prompt)", "8 replicas hold the prompt"),
    (" (a prompt no replica holds)", " (a prompt no replica holds)", "no replica holds it"),
    (" (the held prompt, its first block on every replica)", " (the held prompt, its first block on every replica)",
     "held, first block on every replica"),
    (" (only the first block on every replica)", " (only the first block on every replica)",
     "only the first block, on every replica"),
    (f" {HOST_RUNS}", f" {HOST_RUNS}", "that prompt, the rest on 8 host tiers"),
)


def plot(report: dict, path: Path) -> None:
    """Three panels: p99 of each policy's decision for the held prompt; cache_aware's p99
    by prompt kind, shipped (solid) against every replica weighed (dashed); index work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axk, ax2) = plt.subplots(1, 3, figsize=(15.0, 4.6))
    by_policy: dict[str, list[dict]] = {}
    for r in report["decisions"]:
        by_policy.setdefault(r["policy"], []).append(r)

    def line(axis, name, label, **kw):
        rows = by_policy.get(name)
        if rows:
            return axis.plot([r["replicas"] for r in rows], [r["p99_us"] / 1000 for r in rows], marker="o",
                             label=label, **kw)[0]
        return None

    for name in ("round_robin", "least_loaded", "sglang", "cache_aware", "cache_aware (live: ClusterView.loads + choose)",
                 "cache_aware (a template request)"):
        line(ax, name, name)
    for axis in (ax, axk):
        axis.axhline(1.0, color="grey", linewidth=0.8, linestyle=":", label="target p99 1 ms")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("replicas")
    ax.set_ylabel("decision cost p99, CPU (ms)")
    ax.set_title("Policies, the prompt 8 replicas hold")
    ax.legend(fontsize=7)
    for shipped, full, label in PROMPT_KINDS:
        first = line(axk, f"cache_aware{shipped}", label)
        if first is not None:
            line(axk, f"{FULL_PASS}{full}", f"{label}, every replica weighed", color=first.get_color(), linestyle="--")
    axk.set_yscale("log")
    axk.set_ylabel("cache_aware p99, CPU (ms, log)")
    axk.set_title("cache_aware by prompt (dashed: every replica weighed)")
    axk.legend(fontsize=6)
    xs = [r["replicas"] for r in report["lookups"]]
    for key, label in (("prefix_matches", "hash -> replicas walk (prefix_matches)"),
                       ("match_per_replica", "match() per replica")):
        ax2.plot(xs, [r[key]["p50_us"] / 1000 for r in report["lookups"]], marker="o", label=f"{label} p50")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("replicas")
    ax2.set_ylabel("index work, CPU (ms)")
    ax2.set_title("Index lookups (8 replicas hold the prefix)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"Routing decision vs fleet size ({report['config']['blocks']:,} indexed blocks)")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleets", default="8,64,256,1024")
    ap.add_argument("--blocks", type=int, default=100_000, help="distinct block hashes indexed (default 100,000)")
    ap.add_argument("--copies", type=int, default=2, help="replicas holding each filler chain (default 2)")
    ap.add_argument("--policies", default="round_robin,least_loaded,cache_aware,sglang",
                    help="registry names, each optionally name:key=value&key=value (JSON values)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--queue-shares", action="store_true",
                    help="give cache_aware a queue share for every replica with a queue (as if other routers' "
                         "requests waited there): the share's worst case")
    ap.add_argument("--bw-requests", type=int, default=2000, help="0 skips the bandwidth part")
    ap.add_argument("--bw-replicas", type=int, default=8)
    ap.add_argument("--bw-capacity", type=int, default=1000, help="KV blocks per replica in the bandwidth replay")
    ap.add_argument("--bw-block-size", type=int, default=512)
    ap.add_argument("--trace", type=Path, default=None, help="trace for the bandwidth part (default: Mooncake)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    fleets = [int(x) for x in args.fleets.split(",")]
    policies = args.policies.split(",")
    if "round_robin" not in policies:
        policies.insert(0, "round_robin")
    decisions, lookups, cold_phases = [], [], []
    steps = tqdm(total=len(fleets) * (len(policies) + 9), desc="decisions", file=sys.stderr, unit="run")
    for n in fleets:
        prompt, index, loads = build_index(n, args.blocks, args.copies)
        entries = index.num_entries()
        steps.set_postfix_str(f"{n} replicas")
        rows = []
        for name in policies:
            rows.append({"replicas": n, "entries": entries, "policy": name,
                         **time_policy(name, prompt, index, loads, args.iters, args.queue_shares)})
            steps.update()
        rows.append({"replicas": n, "entries": entries, "policy": "cache_aware (live: ClusterView.loads + choose)",
                     **time_live("cache_aware", prompt, index, loads, args.iters, args.queue_shares)})
        steps.update()
        cold = _hashes(random.Random(n + 1), PROMPT_BLOCKS)  # no replica holds any of it
        rows.append({"replicas": n, "entries": entries, "policy": "cache_aware (a prompt no replica holds)",
                     **time_policy("cache_aware", cold, index, loads, args.iters, args.queue_shares)})
        steps.update()
        # the same two prompts with every replica weighed: what the candidate window saves
        rows.append({"replicas": n, "entries": entries, "policy": f"{FULL_PASS} (the held prompt)",
                     **time_policy(FULL_PASS, prompt, index, loads, args.iters, args.queue_shares)})
        rows.append({"replicas": n, "entries": entries, "policy": f"{FULL_PASS} (a prompt no replica holds)",
                     **time_policy(FULL_PASS, cold, index, loads, args.iters, args.queue_shares)})
        steps.update(2)
        cold_phases.append({"replicas": n, **time_cold_phases(cold, index, loads, min(args.iters, 500),
                                                               args.queue_shares)})
        templated = RequestClass(template=True, template_blocks=TEMPLATE_BLOCKS)  # its home: the ring's owner
        rows.append({"replicas": n, "entries": entries, "policy": "cache_aware (a template request)",
                     **time_policy("cache_aware", prompt, index, loads, args.iters, args.queue_shares, templated)})
        steps.update()
        lookups.append({"replicas": n, **time_lookup(index, loads, prompt, min(args.iters, 500))})
        steps.update()
        # a shared system prompt: every replica also holds the prompt's first block (last:
        # the index changes for the rows after), with the 8 holders' longer prefixes
        # as before, and a prompt that shares only that block with anything indexed
        for r in loads:
            index.apply_events_unchecked(r.replica_id, [prompt[0]], [])
        shared_tail = [prompt[0], *_hashes(random.Random(n + 2), PROMPT_BLOCKS - 1)]
        for name in ("cache_aware", FULL_PASS):
            rows.append({"replicas": n, "entries": index.num_entries(), "policy": f"{name} (the held prompt, its first block on every replica)",
                         **time_policy(name, prompt, index, loads, args.iters, args.queue_shares)})
            rows.append({"replicas": n, "entries": index.num_entries(), "policy": f"{name} (only the first block on every replica)",
                         **time_policy(name, shared_tail, index, loads, args.iters, args.queue_shares)})
            steps.update()
        # and 8 replicas spread over the fleet (besides the 8 holders, where the fleet has
        # others) hold the rest of that prompt in their host tiers: above 32 replicas found
        # in the first block's group, by one set intersection
        others = loads[HOLDERS:] or loads
        for r in others[::max(1, len(others) // 8)][:8]:
            index.apply_events_unchecked(r.replica_id, [], [], host_stored=shared_tail[1:])
        for name in ("cache_aware", FULL_PASS):
            rows.append({"replicas": n, "entries": index.num_entries(), "policy": f"{name} {HOST_RUNS}",
                         **time_policy(name, shared_tail, index, loads, args.iters, args.queue_shares)})
        steps.update()
        base = next(r for r in rows if r["policy"] == "round_robin")["p50_us"]
        for r in rows:
            r["p50_ratio_to_round_robin"] = round(r["p50_us"] / base, 1)
        decisions += rows
        del prompt, index, loads
    steps.close()
    report = {"commit": git_commit(Path(__file__).resolve().parents[1]), "config": vars(args) | {"trace": str(args.trace)},
              "decisions": decisions, "lookups": lookups, "cold_phases": cold_phases,
              "memory": index_bytes(max(fleets), args.blocks, args.copies)}
    if args.bw_requests:
        report["bandwidth"] = bandwidth(args.trace or mooncake_trace(), args.bw_requests, args.bw_replicas,
                                        args.bw_capacity, args.bw_block_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report["config"]["out_dir"] = str(args.out_dir)
    write_report(args.out_dir, "fleet_scale", report, markdown(report), plot)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
