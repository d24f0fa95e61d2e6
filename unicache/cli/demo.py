"""``unicache demo``: a short heterogeneous workload through a running router.

Sends chat sessions (each turn repeats the conversation so far), requests sharing a few
system-prompt templates, and plain one-off prompts, with a progress bar; then prints the
cluster's per-replica cache state and the prompt-token hit ratio the workload achieved,
so a newcomer sees routing and caching at work. Then (``--fill``, on by default) one-off
prompts fill every replica's cache until it evicts, the sessions and templates come back,
and the demo says how much of them UniCache kept that an LRU cache of the same size would
have lost (unicache/cli/demo_eviction.py says why that figure is exact).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from unicache.contract.endpoints import LOCAL_ROUTER, ROUTER_ENV, default_router
from unicache.contract.redis_keys import HEARTBEAT_INTERVAL_S
from unicache.plumbing.errors import UsageError
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

TEMPLATES = [
    "You are a careful code reviewer. Point out bugs, races and missing tests in the diff below. " * 4,
    "You are a SQL assistant. Answer with one query over the schema users(id, name), orders(id, user_id, total). " * 4,
    "You are a travel planner. Answer with a day-by-day itinerary, budget and packing list. " * 4,
]
TOPICS = ["caching", "routing", "eviction", "batching", "tokenizers", "schedulers", "sharding", "replication"]


@dataclass(slots=True)
class DemoRequest:
    kind: str  # session, template, single
    text: str = ""
    chat: list[dict] | None = None
    session_id: str = ""
    wave: int = 0  # requests of one wave run concurrently; waves run in order


def build_workload(seed: int, sessions: int, turns: int, templated: int, single: int) -> list[DemoRequest]:
    """A deterministic mix; session turn k is in wave k so turns stay ordered."""
    rng = random.Random(seed)
    out: list[DemoRequest] = []
    for s in range(sessions):
        messages = [{"role": "system", "content": f"Session {s}: a friendly tutor on {TOPICS[s % len(TOPICS)]}."}]
        for t in range(turns):
            messages = messages + [{"role": "user", "content": f"Question {t}: explain {rng.choice(TOPICS)} in depth."}]
            out.append(DemoRequest("session", chat=list(messages), session_id=f"demo-{seed}-{s}", wave=t))
            messages = messages + [{"role": "assistant", "content": f"Answer {t} about {rng.choice(TOPICS)}."}]
    for i in range(templated):
        tpl = TEMPLATES[min(int(rng.paretovariate(1.2)) - 1, len(TEMPLATES) - 1)]
        out.append(DemoRequest("template", text=tpl + f"\nInput {i}: {rng.choice(TOPICS)} {rng.random():.6f}", wave=i % turns))
    for i in range(single):
        out.append(DemoRequest("single", text=f"One-off {i}: {rng.random():.9f} " * 6, wave=i % turns))
    return out


def returning_requests(workload: list[DemoRequest]) -> list[DemoRequest]:
    """After the flood: each session's next turn (its conversation so far plus a question)
    and one new request per template used."""
    out: list[DemoRequest] = []
    last: dict[str, DemoRequest] = {}
    for r in workload:
        if r.kind == "session":
            last[r.session_id] = r
    for sid, r in last.items():
        chat = r.chat + [{"role": "assistant", "content": "Answer."}, {"role": "user", "content": "One more question: why?"}]
        out.append(DemoRequest("returning", chat=chat, session_id=sid))
    seen = []
    for r in workload:
        if r.kind == "template":
            tpl = next(t for t in TEMPLATES if r.text.startswith(t))
            if tpl not in seen:
                seen.append(tpl)
                out.append(DemoRequest("returning", text=tpl + "\nInput again: after the flood"))
    return out


def _send(stub: router_pb2_grpc.RouterStub, req: DemoRequest, max_tokens: int, metadata, timeout_s: float) -> dict:
    kwargs = {"sampling": common_pb2.SamplingParams(max_tokens=max_tokens)}
    if req.chat is not None:
        kwargs["chat_json"] = json.dumps(req.chat)
    else:
        kwargs["text"] = req.text
    if req.session_id:
        kwargs["session_id"] = req.session_id
    result = {"kind": req.kind, "replica": "", "reason": "", "prompt": 0, "cached": 0}
    for msg in stub.Generate(router_pb2.RouterGenerateRequest(**kwargs), metadata=metadata, timeout=timeout_s):
        if msg.HasField("route"):
            result["replica"], result["reason"] = msg.route.replica_id, msg.route.reason
        if msg.HasField("usage"):
            result["prompt"], result["cached"] = msg.usage.prompt_tokens, msg.usage.cached_tokens
    return result


def run_demo(args: argparse.Namespace) -> int:
    from unicache.router.observability.status import admin_key_from_env, fetch_cluster_state, format_table

    workload = build_workload(args.seed, args.sessions, args.turns, args.templated, args.single)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    results: list[dict] = []
    with grpc.insecure_channel(args.router) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=args.timeout)
        except grpc.FutureTimeoutError:
            raise UsageError(f"router {args.router} unreachable") from None
        stub = router_pb2_grpc.RouterStub(channel)
        waves = collections.defaultdict(list)
        for r in workload:
            waves[r.wave].append(r)
        with ThreadPoolExecutor(args.concurrency) as pool, tqdm(total=len(workload), desc="demo", unit="req") as bar:
            for w in sorted(waves):
                futures = [pool.submit(_send, stub, r, args.max_tokens, metadata, args.timeout) for r in waves[w]]
                for f in futures:
                    try:
                        results.append(f.result())
                    except grpc.RpcError as exc:
                        raise UsageError(f"request failed: {exc.code().name}: {exc.details()}") from None
                    bar.update(1)
    # NOTE: replicas report load and cache state in their heartbeats; wait one period so
    # the table shows the state after this workload rather than during it.
    time.sleep(HEARTBEAT_INTERVAL_S + 0.2)
    print(format_table(fetch_cluster_state(args.router, args.timeout, admin_key_from_env())))
    print()
    print(f"{'requests':10s} {'n':>4s} {'prompt tok':>11s} {'cached tok':>11s} {'hit%':>6s}")
    for kind in ("session", "template", "single", "all"):
        rows = [r for r in results if kind == "all" or r["kind"] == kind]
        prompt = sum(r["prompt"] for r in rows)
        cached = sum(r["cached"] for r in rows)
        print(f"{kind:10s} {len(rows):4d} {prompt:11d} {cached:11d} {100 * cached / max(prompt, 1):6.1f}")
    reasons = collections.Counter(r["reason"] for r in results)
    placed = collections.Counter(r["replica"] for r in results)
    print("routing reasons: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())))
    print("requests per replica: " + ", ".join(f"{k}={v}" for k, v in sorted(placed.items())))
    if args.fill:
        print()
        for line in run_fill(args, workload, metadata).lines():
            print(line)
    return 0


def _result(future) -> dict:
    try:
        return future.result()
    except grpc.RpcError as exc:
        raise UsageError(f"request failed: {exc.code().name}: {exc.details()}") from None


def run_fill(args: argparse.Namespace, workload: list[DemoRequest], metadata):
    """Flood every replica with one-off prompts until each has cached at least its capacity
    of new blocks (it evicts), then send the returning sessions and templates."""
    from unicache.cli.demo_eviction import FillReport, ReplicaFill, flood_text
    from unicache.router.observability.status import admin_key_from_env, fetch_cluster_state

    admin_key = admin_key_from_env()
    state = fetch_cluster_state(args.router, args.timeout, admin_key)
    report = FillReport(block_size=state.replicas[0].cache.block_size if state.replicas else 16)
    for rs in state.replicas:
        report.replicas[rs.info.replica_id] = ReplicaFill(rs.cache.capacity_blocks, evictions_before=rs.cache.evictions)
    need = sum(r.capacity_blocks for r in report.replicas.values())
    per_request = max(1, (args.flood_chars - 1) // report.block_size)
    limit = 3 * (need // per_request + 1) + 2 * args.concurrency  # routing may be uneven: bounded
    sent, chars = 0, args.flood_chars
    with grpc.insecure_channel(args.router) as channel, ThreadPoolExecutor(args.concurrency) as pool:
        stub = router_pb2_grpc.RouterStub(channel)
        with tqdm(total=need, desc="filling the caches", unit="block") as bar:
            while not report.all_filled() and sent < limit:
                wave = [DemoRequest("flood", text=flood_text(args.seed, sent + i, chars)) for i in range(args.concurrency)]
                sent += len(wave)
                for f in [pool.submit(_send, stub, r, 1, metadata, args.timeout) for r in wave]:
                    try:
                        res = f.result()
                    except grpc.RpcError as exc:
                        # NOTE: a model with a shorter context than --flood-chars tokens: halve and go on
                        if "exceeds the context" not in (exc.details() or "") or chars <= 64:
                            raise UsageError(f"request failed: {exc.code().name}: {exc.details()}") from None
                        chars //= 2
                        continue
                    before = sum(min(r.flood_blocks, r.capacity_blocks) for r in report.replicas.values())
                    report.add_flood(res["replica"], res["prompt"])
                    bar.update(sum(min(r.flood_blocks, r.capacity_blocks) for r in report.replicas.values()) - before)
        for f in [pool.submit(_send, stub, r, args.max_tokens, metadata, args.timeout) for r in returning_requests(workload)]:
            res = _result(f)
            report.add_returning(res["replica"], res["prompt"], res["cached"])
    time.sleep(HEARTBEAT_INTERVAL_S + 0.2)  # NOTE: evictions are read from the replicas' heartbeats
    for rs in fetch_cluster_state(args.router, args.timeout, admin_key).replicas:
        if rs.info.replica_id in report.replicas:
            report.replicas[rs.info.replica_id].evictions_after = rs.cache.evictions
    return report


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="send a short mixed workload through a running router and show the cache at work")
    p.add_argument("--router", default=default_router(), metavar="HOST:PORT",
                   help=f"router gRPC address (env {ROUTER_ENV}; default: the local router, {LOCAL_ROUTER})")
    p.add_argument("--api-key", default=os.environ.get("UNICACHE_API_KEY", ""), help="API key (env UNICACHE_API_KEY; none in local mode)")
    p.add_argument("--sessions", type=int, default=4, help="chat sessions (default 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    p.add_argument("--templated", type=int, default=12, help="requests sharing system-prompt templates (default 12)")
    p.add_argument("--single", type=int, default=6, help="one-off requests (default 6)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fill", action=argparse.BooleanOptionalAction, default=True,
                   help="then fill every replica's cache with one-off prompts until it evicts, bring the sessions and "
                        "templates back, and compare with LRU (default on)")
    p.add_argument("--flood-chars", type=int, default=3000, help="characters per one-off prompt of --fill (default 3000)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline per request in seconds")
    p.set_defaults(func=run_demo)
