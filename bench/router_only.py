"""Routers alone in front of the same fake vLLM servers, in one run: this router, vllm-router,
sglang-router and smg, CPU per request, added latency and requests/s per core (issue 44).

The backends are fake vLLM OpenAI servers (``unicache.testing.fake_vllm`` with vLLM's KV
events: the full prompt blocks a request adds to the cache published as one ``BlockStored``
per run of new blocks, as vLLM's ``cache_full_blocks`` does, on ZMQ, with a replay socket, and evicted LRU from a pool of ``--pool-blocks``; usage reports the cached
tokens), all in one process of their own, streaming ``--max-tokens`` tokens per answer at
once: the routers' own costs are what is left. Every router runs in its own process with
its cache-aware policy (this one: ``unicache router --backend URL,kv-events=...,replay=...``,
``cache_aware``, no Redis; the peers: their documented command line from
``bench.live_ab_arms``, in a virtual environment of their own, ``--install-peers``). The
``direct`` row sends the same requests straight to one fake server: the floor the added
latency is measured against.

Workloads (``--workloads``): ``prompts``: 2,000-token completion prompts, each a shared
1,500-token prefix (one of ``--prefixes``) and a unique 500-token tail; ``chat``: 10-turn
chats (``/v1/chat/completions``), each turn the whole history plus a new 150-token user
message. Every request streams (``stream_options.include_usage``).

Loads: each ``--rates`` value (requests/s, open loop: requests start on schedule whatever
the answers) and saturation (``--concurrency`` requests in flight, closed loop). Figures
per (router, workload, load), per round, rounds interleaved (``bench.rounds``), medians:
the router process's CPU per request (all threads, /proc), latency to the end of each
response p50 / p99 and its addition over ``direct`` in the same round, requests/s, and at
saturation requests/s per router core (requests per CPU-second of the router process).
The load client is one Python process on the router's own HTTP client
(``unicache.router.upstream.vllm_fleet.http_pool``).

Run (from the repository root; the peers install into ``--peer-venv``, default
/tmp/unicache-peers, never into the project's venv):
    .venv/bin/python -m bench.router_only --install-peers vllm-router,sglang-router,smg
    .venv/bin/python -m bench.router_only [--routers unicache,vllm-router,sglang-router,smg] [--rounds 3]
        [--requests 400] [--rates 20,50] [--concurrency 32] [--workloads prompts,chat] [--out-dir bench/results]
        [--unicache-workers 1,2,4]
``--unicache-workers`` runs this router once per count (``unicache router --workers N``, rows
``unicache``, ``unicache-w2``, ...; each worker follows every fake server's events itself),
its CPU summed over the supervisor and its workers: throughput per pod by worker count.
A tiny check that it works: ``--routers unicache --rounds 1 --requests 20 --rates 10 --concurrency 4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path

from unicache.plumbing.redis_server import free_port
from unicache.sim.metrics import percentile
from unicache.testing.procfs import child_pids, cpu_s
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from bench.live_ab_arms import ARMS, PEERS, Router, install_peers, missing_peers
from bench.paths import REPO, RESULTS
from bench.report_files import git_commit, write_report
from bench.rounds import round_order

MODEL = "tiny"
BLOCK_SIZE = 16
SERVERS = 2
KEY = "bench-key"
PROMPT_TOKENS, PREFIX_TOKENS, TURNS, TURN_TOKENS = 2000, 1500, 10, 150


def words(seed: int, n: int) -> str:
    """``n`` words of the tiny tokenizer (one token each), different per ``seed``."""
    step = 1 + seed % 7
    return " ".join(WORDS[(seed * 31 + i * step) % len(WORDS)] for i in range(n))


# --- the fake vLLM servers ------------------------------------------------------------------
def fleet_main(n: int, model_dir: str, pool_blocks: int, max_tokens: int, ports, stop) -> None:
    """``n`` fake vLLM servers with KV events on one uvloop until ``stop``; puts
    ("fleet", [(http, events, replay) ports], pid) to ``ports``."""
    import msgspec
    import uvloop
    import zmq
    import zmq.asyncio

    from unicache.contract.chat_template import render_chat
    from unicache.contract.tokenizer import load_tokenizer
    from unicache.contract.vllm_events import END_SEQ, VllmBlockRemoved, VllmBlockStored, VllmEventBatch
    from unicache.testing.fake_vllm import FakeVllm, model_card

    tok = load_tokenizer(f"{model_dir}/tokenizer.json")
    info = json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True, "object": "list",
                       "data": [model_card(MODEL)]}).encode()

    class EventingVllm(FakeVllm):
        """A fake vLLM server that caches each prompt's full blocks (LRU) and publishes them
        as vLLM does; its usage reports the prefix it had cached."""

        def __init__(self, ctx):
            super().__init__([model_card(MODEL)], BLOCK_SIZE, max_tokens)
            self.gpu_blocks = pool_blocks
            self.cache: OrderedDict[int, None] = OrderedDict()
            self.pub = ctx.socket(zmq.PUB)
            self.events_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
            self.seq = 0
            self.kept: OrderedDict[int, bytes] = OrderedDict()  # the replay buffer (last 1,000 batches)
            self._replay_task = asyncio.create_task(self._serve_replay())

        def _other(self, path: str) -> tuple[int, str, bytes]:
            return 200, "application/json", info  # the peers' model-info probes

        @staticmethod
        def _stored(run: list[int], chain: list[int], ids: list[int], salt: str | None) -> "VllmBlockStored":
            """One event for a run of consecutive new blocks, as vLLM's ``cache_full_blocks``
            publishes every block a request step caches in one ``BlockStored``."""
            first = run[0]
            return VllmBlockStored([chain[i] for i in run], chain[first - 1] if first else None,
                                   list(ids[first * BLOCK_SIZE:(run[-1] + 1) * BLOCK_SIZE]), BLOCK_SIZE,
                                   extra_keys=[[salt] if i == 0 and salt else None for i in run] if salt else None)

        async def _serve_replay(self) -> None:
            while True:
                ident, _, start = await self.replay.recv_multipart()
                start = int.from_bytes(start, "big")
                for seq, payload in self.kept.items():
                    if seq >= start:
                        await self.replay.send_multipart((ident, b"", b"kv-events", seq.to_bytes(8, "big"), payload))
                await self.replay.send_multipart((ident, b"", b"kv-events", END_SEQ, b""))

        async def _generate(self, path: str, body: dict, writer, mode: str) -> bool:
            if path.endswith("/chat/completions"):
                ids = list(tok.encode(render_chat(body.get("messages"), tok.chat_template), False))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]  # a batch of one, as some routers forward a prompt
                if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
                    self._send(writer, 400, "application/json", b'{"error":{"message":"prompt must be a string or token ids"}}')
                    await writer.drain()
                    return True
                ids = prompt if isinstance(prompt, list) else list(tok.encode(prompt, True))
            salt = body.get("cache_salt")
            stored, removed, parent, cached, hit = [], [], None, 0, True
            chain: list[int] = []
            run: list[int] = []  # block indices of the run of new blocks being stored
            for i in range(len(ids) // BLOCK_SIZE):
                block = tuple(ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                h = hash((parent, block, salt if i == 0 else None)) & 0x7FFFFFFFFFFFFFFF
                chain.append(h)
                if h in self.cache:
                    self.cache.move_to_end(h)
                    cached += BLOCK_SIZE if hit else 0
                    if run:
                        stored.append(self._stored(run, chain, ids, salt))
                        run = []
                else:
                    hit = False
                    self.cache[h] = None
                    run.append(i)
                parent = h
            if run:
                stored.append(self._stored(run, chain, ids, salt))
            # NOTE: as vLLM frees a finished request's blocks tail first, a chain's head is the
            # most recently used and its tail goes first: a block never outlives its parent
            # (evicting heads first made the router reset its index on unknown parents).
            for h in reversed(chain):
                self.cache.move_to_end(h)
            while len(self.cache) > pool_blocks:
                removed.append(self.cache.popitem(last=False)[0])
            body["prompt"] = ids  # the usage's prompt_tokens
            self.cached_tokens = cached
            if stored or removed:
                # NOTE: vLLM evicts a block when it allocates its replacement, before the
                # replacement is filled and cached: removals come first.
                events = ([VllmBlockRemoved(removed)] if removed else []) + stored
                payload = msgspec.msgpack.encode(VllmEventBatch(time.time(), events))
                seq, self.seq = self.seq, self.seq + 1
                self.kept[seq] = payload
                while len(self.kept) > 1000:
                    self.kept.popitem(last=False)
                await self.pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))
            return await super()._generate(path, body, writer, mode)

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        fakes = [EventingVllm(ctx) for _ in range(n)]
        for f in fakes:
            await f.start()
        ports.put(("fleet", [(f.port, f.events_port, f.replay_port) for f in fakes], os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for f in fakes:
            await f.stop()

    uvloop.run(run())


# --- the load -----------------------------------------------------------------------------
def workload(kind: str, requests: int, max_tokens: int, prefixes: int) -> list[tuple[str, dict, int]]:
    """(path, body, session) of each request in send order; a chat turn's session (>= 0)
    must finish its previous turn first (its history has the answer)."""
    out = []
    if kind == "prompts":
        for i in range(requests):
            prompt = words(i % prefixes, PREFIX_TOKENS) + " " + words(10_000 + i, PROMPT_TOKENS - PREFIX_TOKENS)
            out.append(("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                            "stream_options": {"include_usage": True}}, -1))
        return out
    sessions = max(1, requests // TURNS)
    for turn in range(TURNS):
        for s in range(sessions):
            if len(out) < requests:
                out.append(("/v1/chat/completions", {"model": MODEL, "max_tokens": max_tokens, "stream": True,
                                                     "stream_options": {"include_usage": True},
                                                     "turn": turn}, s))
    return out


async def drive(port: int, reqs: list[tuple[str, dict, int]], rate: float, concurrency: int) -> dict:
    """Send ``reqs`` to ``port``: open loop at ``rate`` requests/s, or closed loop with
    ``concurrency`` in flight (``rate`` 0). Latency: to the end of each response."""
    from unicache.router.upstream.vllm_fleet.http_pool import HttpPool

    pool = HttpPool(f"http://127.0.0.1:{port}", max_idle=max(concurrency, 64))
    histories: dict[int, list[dict]] = {}
    done: dict[int, asyncio.Event] = {}
    latencies: list[float] = []
    matched: list[int] = []  # this router's x-unicache-matched-tokens: its index at work
    failed = 0
    errors: Counter = Counter()  # failures by kind: "http STATUS: message", "incomplete", an exception's name
    auth = f"Authorization: Bearer {KEY}\r\n".encode()

    async def one(path: str, body: dict, session: int) -> None:
        nonlocal failed
        if session >= 0:
            turn = body.pop("turn")
            if turn:
                await done[(session, turn - 1)].wait()
            history = histories.setdefault(session, [])
            history.append({"role": "user", "content": words(session * 100 + turn, TURN_TOKENS)})
            body = {**body, "messages": list(history)}
        t0 = time.perf_counter()
        text = []
        try:
            r = await pool.request("POST", path, json.dumps(body).encode(), auth)
            try:
                data = await r.read()
            finally:
                r.close()
            if "x-unicache-matched-tokens" in r.headers:
                matched.append(int(r.headers["x-unicache-matched-tokens"]))
            if r.status != 200:
                failed += 1
                errors[f"http {r.status}: {data[:120].decode(errors='replace')}"] += 1
            elif not data.rstrip().endswith(b"[DONE]"):
                failed += 1
                errors["incomplete"] += 1
            elif session >= 0:
                for event in data.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        for choice in json.loads(event[6:]).get("choices") or ():
                            text.append((choice.get("delta") or {}).get("content") or "")
        except Exception as exc:  # noqa: BLE001 - counted as a failure
            failed += 1
            errors[type(exc).__name__] += 1
        latencies.append(time.perf_counter() - t0)
        if session >= 0:
            histories[session].append({"role": "assistant", "content": "".join(text)})
            done[(session, turn)].set()

    for _, body, session in reqs:
        if session >= 0:
            done[(session, body["turn"])] = asyncio.Event()
    t0 = time.perf_counter()
    if rate > 0:
        tasks = []
        for i, (path, body, session) in enumerate(reqs):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(path, dict(body), session)))
        await asyncio.gather(*tasks)
    else:
        queue = list(reversed(reqs))

        async def worker() -> None:
            while queue:
                path, body, session = queue.pop()
                await one(path, dict(body), session)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    pool.close()
    lat = sorted(latencies)
    return {"p50_ms": round(1e3 * percentile(lat, 50), 3), "p99_ms": round(1e3 * percentile(lat, 99), 3),
            "requests_per_s": round(len(reqs) / wall, 1), "failed": failed, **({"errors": dict(errors)} if errors else {}),
            **({"matched_tokens_mean": round(statistics.fmean(matched), 1)} if matched else {})}


def client_main(port: int, reqs, rate: float, concurrency: int, out) -> None:
    import uvloop

    out.put(uvloop.run(drive(port, reqs, rate, concurrency)))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and its children (a router's workers)."""
    total = cpu_s(pid)
    for child in child_pids(pid):
        try:
            total += cpu_s(child)
        except OSError:
            pass  # ended meanwhile
    return total


def measure(ctx, port: int, pid: int | None, reqs, rate: float, concurrency: int) -> dict:
    """One load against ``port`` from a client process; the CPU of process ``pid`` (and its
    children: a router's workers) per request."""
    out = ctx.Queue()
    c0 = tree_cpu_s(pid) if pid else 0.0
    p = ctx.Process(target=client_main, args=(port, reqs, rate, concurrency, out))
    p.start()
    res = out.get(timeout=3600)
    p.join(30)
    if pid:
        cpu = tree_cpu_s(pid) - c0
        res["cpu_ms_per_request"] = round(1e3 * cpu / len(reqs), 4)
        res["requests_per_cpu_s"] = round(len(reqs) / cpu, 1) if cpu > 0 else None
    return res


def every_worker_ready(url: str, servers: int, workers: int, timeout_s: float = 120.0) -> None:
    """Until ``4 x workers`` fresh connections in a row (the kernel spreads them over the
    workers) each find a worker that knows every server."""
    import httpx

    deadline = time.monotonic() + timeout_s
    ok = 0
    while ok < 4 * workers:
        try:
            ok = ok + 1 if len(httpx.get(f"{url}/v1/cluster/state", timeout=5).json().get("replicas", [])) == servers else 0
        except (httpx.HTTPError, ValueError):
            ok = 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not every one of {workers} workers knows the {servers} servers within {timeout_s:.0f} s")
        if ok == 0:
            time.sleep(0.5)


# --- the run ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default="unicache,vllm-router,sglang-router,smg")
    ap.add_argument("--workloads", default="prompts,chat")
    ap.add_argument("--requests", type=int, default=400, help="requests per (router, workload, load) and round")
    ap.add_argument("--rates", default="20,50", help="fixed rates, requests/s (comma-separated; saturation is added)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight at saturation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=8, help="shared 1,500-token prefixes of the prompts workload")
    ap.add_argument("--pool-blocks", type=int, default=20_000, help="each fake server's cache, in blocks")
    ap.add_argument("--peer-venv", default="/tmp/unicache-peers")
    ap.add_argument("--unicache-workers", default="1", help="this router's worker counts, one run each (e.g. 1,2,4)")
    ap.add_argument("--install-peers", default="", help="install these peers into --peer-venv, then exit")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--json", default=None, help="also write the report's JSON to this file (bench.ab_commits' {out})")
    args = ap.parse_args(argv)
    venv = Path(args.peer_venv)
    if args.install_peers:
        for name, version in install_peers([p for p in args.install_peers.split(",") if p], venv).items():
            print(f"{name}: {version}")
        return 0
    routers = [r for r in args.routers.split(",") if r]
    peers = [r for r in routers if r != "unicache"]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown routers {unknown}; known: unicache, {', '.join(PEERS)}")
    refusals = missing_peers(peers, venv)
    if refusals:
        ap.error("; ".join(r.replace("python -m bench.live_ab --install-peers", "python -m bench.router_only --install-peers")
                           for r in refusals))
    loads = [float(r) for r in args.rates.split(",") if r] + [0.0]  # 0: saturation
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    rounds: list[dict] = []
    running: list[Router] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(f"{tmp}/model", chat_template=True)
        fleet = ctx.Process(target=fleet_main, args=(SERVERS, model_dir, args.pool_blocks, args.max_tokens, ports, stop))
        fleet.start()
        try:
            _, fleet_ports, fleet_pid = ports.get(timeout=120)
            urls = [f"http://127.0.0.1:{h}" for h, _, _ in fleet_ports]
            backends = [f"{u},kv-events=tcp://127.0.0.1:{e},replay=tcp://127.0.0.1:{r}" for u, (_, e, r) in zip(urls, fleet_ports)]
            targets: dict[str, tuple[int, int | None]] = {"direct": (fleet_ports[0][0], None)}
            counts = [int(n) for n in args.unicache_workers.split(",") if n]
            arms = [(f"unicache-w{n}" if n > 1 else name, name, n) for name in routers for n in (counts if name == "unicache" else [1])]
            for label, name, n in arms:
                arm = ARMS["ours" if name == "unicache" else name]
                extra = ("--workers", str(n), "--grpc-port", str(free_port())) if n > 1 else ()
                router = Router(arm, backends, urls, model_dir, MODEL, BLOCK_SIZE, {"bench": KEY}, venv, f"{tmp}/{label}.log", extra)
                running.append(router)
                router.wait_ready(MODEL, KEY)
                if n > 1:
                    every_worker_ready(router.url, len(urls), n)
                targets[label] = (router.port, router.proc.pid)
            names = list(targets)
            for i in range(args.rounds):
                row: dict = {}
                for kind in args.workloads.split(","):
                    reqs = workload(kind, args.requests, args.max_tokens, args.prefixes)
                    for load in loads:
                        key = f"{kind} @ {'saturation' if load == 0 else f'{load:g}/s'}"
                        for name in round_order(names, i):
                            port, pid = targets[name]
                            res = measure(ctx, port, pid, reqs, load, args.concurrency)
                            row.setdefault(key, {})[name] = res
                            print(f"round {i + 1}/{args.rounds}: {key}: {name}: {res}", file=sys.stderr, flush=True)
                rounds.append(row)
        finally:
            for router in running:
                router.stop()
            stop.set()
            fleet.join(30)
    summary: dict = {}
    for key in rounds[0]:
        for name in rounds[0][key]:
            rs = [r[key][name] for r in rounds]
            s = {q: statistics.median(x[q] for x in rs) for q in ("p50_ms", "p99_ms", "requests_per_s")}
            s["failed"] = sum(x["failed"] for x in rs)
            if name != "direct":
                s["cpu_ms_per_request"] = statistics.median(x["cpu_ms_per_request"] for x in rs)
                if key.endswith("saturation"):
                    s["requests_per_cpu_s"] = statistics.median(x["requests_per_cpu_s"] or 0 for x in rs)
                for q in ("p50_ms", "p99_ms"):  # over going straight to a fake server, in the same round
                    s[f"added_{q}"] = round(statistics.median(r[key][name][q] - r[key]["direct"][q] for r in rounds), 3)
            summary.setdefault(key, {})[name] = s
    load_avg = os.getloadavg()[0]
    command = "python -m bench.router_only " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command, "host": platform.node() or "unknown", "cpus": os.cpu_count(), "commit": git_commit(REPO),
              "load_average_end": load_avg, "servers": SERVERS, "requests": args.requests, "rounds": args.rounds,
              "summary": summary, "rounds_data": rounds, "wall_s": round(time.perf_counter() - t0, 1)}
    lines = ["# Routers alone in front of fake vLLM servers\n",
             f"Produced by `{command}` at commit {report['commit']} ({report['cpus']} CPUs, 1-minute load average "
             f"{load_avg:.1f} at the end); {SERVERS} fake vLLM servers with KV events, {args.requests} streamed requests of "
             f"{args.max_tokens} tokens per (router, workload, load) and round, {args.rounds} rounds interleaved, medians. "
             "Latency: to the end of each response; added: over sending it straight to a fake server in the same round.\n",
             "| workload @ load | router | CPU ms / request | requests / CPU-second | latency p50 / p99 ms | added p50 / p99 ms "
             "| requests/s | failed |", "|---|---|---|---|---|---|---|---|"]
    for key, rows in summary.items():
        for name, s in rows.items():
            cpu = f"{s['cpu_ms_per_request']:.3f}" if "cpu_ms_per_request" in s else "-"
            per_core = f"{s['requests_per_cpu_s']:.0f}" if "requests_per_cpu_s" in s else "-"
            added = f"{s['added_p50_ms']:+.3f} / {s['added_p99_ms']:+.3f}" if "added_p50_ms" in s else "-"
            lines.append(f"| {key} | {name} | {cpu} | {per_core} | {s['p50_ms']:.3f} / {s['p99_ms']:.3f} | {added} "
                         f"| {s['requests_per_s']:.0f} | {s['failed']} |")
    write_report(Path(args.out_dir), "router_only", report, "\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(s["failed"] == 0 for rows in summary.values() for s in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
