"""What sharing cache_aware's terms between routers costs each router, per request.

The exchange (``unicache.router.cluster.terms_exchange``) adds three kinds of work to a router:
recording each decision as a ``RoutedEvent`` (on the request path), sending its events as
one sealed batch per interval (``publish``: seal + XADD), and applying the other routers'
batches (``read``: XREAD + MAC check + parse + ``apply_routed``, whose decays walk every
replica's churn and footprint entries, as routing a request oneself does). Measured
against a private redis-server on loopback, this process's CPU time (the router's side;
the Redis server's own CPU is not in it), in interleaved rounds, medians over rounds:

    * ``route``: ``on_request_routed`` per request, terms shared or not (the recording's
      cost is the difference);
    * ``publish``: per event, batches of ``--batch`` events (50 ms of traffic at
      20 x ``--batch`` requests per second), in a steady state: first 2 requests per
      replica are routed (so every replica holds requests of the writer waiting for their
      first token) and sent as one complete batch; then each batch routes ``--batch`` new
      requests and gives the ``--batch`` oldest their first token, so the queued sums
      travel as changes, with a complete batch every keepalive (0.5 s of the batches'
      50 ms clock);
    * ``apply``: per event, the same batches read and applied by a second exchange, at
      each of ``--replicas`` fleet sizes; each fleet size also as ``_complete``: every
      batch complete (the keepalive below the batches' interval), as the exchange sent
      before it sent changes, rounds interleaved;
    * bytes per event in the stream (events alone: sealed batch without sums / events);
    * the queue share's sums: bytes they add to a complete batch when every replica has
      requests of the writer waiting for their first token, the median sealed size of
      the steady state's complete and delta batches, and the CPU of the reader's round
      ``set_peer_queued(peer_queued())`` after each batch of the steady state (once per
      50 ms round, not per request).

Per request, a router of K that routes 1/K of the traffic pays ``route`` difference +
``publish`` / K + ``apply`` x (K - 1) / K per request of the cluster; the summary gives
K = 2.

    .venv/bin/python -m bench.terms_exchange_cost [--requests 20000] [--rounds 5] [--batch 50] [--json OUT]

With ``--json OUT`` it also draws OUT with the suffix .png: per fleet size, a router of two's
cost per request and the batch bytes, as changes and with every batch complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.cluster.terms_exchange import TermsExchange
from unicache.router.routing.base import RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwarePolicy
from unicache.v1 import router_pb2
from bench.rounds import round_order

BS = 16


def requests(n: int, replicas: int) -> list[tuple[RoutingRequest, RouteDecision]]:
    """Half session turns (64 sessions, 32-block prompts), half one-off 16-block prompts,
    spread over the replicas round robin."""
    out = []
    for i in range(n):
        if i % 2:
            cls, ids = RequestClass(session_id=f"s{i % 64}", task=Task.CHAT), [i % 64] * 1 + list(range(31))
        else:
            cls, ids = RequestClass(task=Task.OTHER), [10_000 + i, *range(15)]
        hs = hash_id_blocks(ids)
        out.append((RoutingRequest(f"q{i}", cls, hs, BS * len(hs), BS), RouteDecision(f"r{i % replicas}", "load", 4)))
    return out


def route_cpu_us(reqs, shared: bool) -> float:
    p = CacheAwarePolicy()
    if shared:
        p.share_terms()
    c0 = time.process_time()
    for req, dec in reqs:
        p.on_request_routed(req, dec)
        if shared and len(p._outbox) >= 1000:
            p.take_routed()
    return 1e6 * (time.process_time() - c0) / len(reqs)


async def exchange_cpu_us(url: str, reqs, batch: int, replicas: int, rnd: int, complete: bool = False) -> dict:
    """One fleet size's steady state (module docstring); ``complete``: every batch
    complete (a keepalive shorter than the batches' 50 ms: what the exchange sent before
    it sent changes)."""
    import redis.asyncio as aioredis

    from unicache.contract.state_auth import parse_cluster_key

    key = parse_cluster_key("ab" * 32)
    ca, cb = aioredis.from_url(url), aioredis.from_url(url)
    known = {f"r{i}" for i in range(replicas)}.__contains__
    pa, pb = CacheAwarePolicy(), CacheAwarePolicy()
    prefix = f"bench{rnd}x{replicas}{'c' if complete else 'd'}"
    clock = [0.0]  # the batches' clock: 50 ms per batch
    a = TermsExchange(ca, prefix, key, pa, known, router_id="a", clock=lambda: clock[0],
                      keepalive_s=0.04 if complete else 0.5)
    b = TermsExchange(cb, prefix, key, pb, known, router_id="b", clock=lambda: clock[0])
    pb.update_replicas(sorted(f"r{i}" for i in range(replicas)))
    for i in range(replicas):  # every replica has churn and footprint entries, as in a busy fleet
        pb._inflow.add(f"r{i}", 1.0)
        pb._footprint.add(f"r{i}", 1.0)
    try:
        await b.read(1)
        warm = 2 * replicas
        for req, dec in reqs[:warm]:  # every replica holds the writer's queued requests
            pa.on_request_routed(req, dec)
        events = pa.take_routed()
        queued = pa.queued_tokens()
        raw = a.encode(events[:batch])
        queued_bytes = len(a.encode(events[:batch], None, queued)) - len(raw)
        a._seq -= 2  # the probes were never sent
        a._pending = list(events)
        await a.publish()  # complete
        await b.read(1)
        publish = read = share = 0.0
        sent = rounds = 0
        for start in range(warm, len(reqs), batch):
            for req, dec in reqs[start:start + batch]:  # routed, not timed
                pa.on_request_routed(req, dec)
            for req, dec in reqs[start - warm:start - warm + batch]:  # the oldest get their first token
                pa.on_first_token(req, dec.replica_id)
            clock[0] += 0.05
            sent += min(batch, len(reqs) - start)
            c0 = time.process_time()
            await a.publish()
            publish += time.process_time() - c0
            c0 = time.process_time()
            await b.read(1)
            read += time.process_time() - c0
            c0 = time.process_time()
            pb.set_peer_queued(b.peer_queued())  # the reader's round (once per 50 ms, not per request)
            share += time.process_time() - c0
            rounds += 1
        assert b.applied_events == warm + sent, (b.applied_events, warm + sent)
        assert b.peer_queued() == pa.queued_tokens()  # the changes kept the reader's view exact
        sizes = {True: [], False: []}
        for _, fields in (await cb.xrange(a.stream))[1:]:
            msg = router_pb2.RoutedBatch.FromString(a.signer.open("routed", fields[b"b"]))
            sizes[msg.delta].append(len(fields[b"b"]))
        share_round = share / rounds
        return {"publish_us": 1e6 * publish / sent, "apply_us": 1e6 * read / sent,
                "bytes_per_event": len(raw) / min(batch, len(events)), "queued_bytes_per_batch": queued_bytes,
                "queued_replicas": len(queued), "share_round_us": 1e6 * share_round,
                "complete_batches": len(sizes[False]), "delta_batches": len(sizes[True]),
                "complete_batch_bytes": statistics.median(sizes[False]) if sizes[False] else 0,
                "delta_batch_bytes": statistics.median(sizes[True]) if sizes[True] else 0}
    finally:
        await ca.aclose()
        await cb.aclose()


async def run(args) -> dict:
    from unicache.plumbing.redis_server import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    fleets = [int(x) for x in args.replicas.split(",")]
    rounds = []
    try:
        for r in range(args.rounds):
            reqs = requests(args.requests, 4)
            rnd = {}
            order = round_order((False, True), r)
            for shared in order:
                rnd["route_shared_us" if shared else "route_alone_us"] = route_cpu_us(reqs, shared)
            for n in fleets:
                for complete in order:
                    rnd[f"exchange_{n}{'_complete' if complete else ''}"] = await exchange_cpu_us(
                        server.url, requests(args.requests, n), args.batch, n, r, complete)
            rounds.append(rnd)
    finally:
        server.close()
    med = {k: statistics.median(r[k] for r in rounds) for k in ("route_alone_us", "route_shared_us")}
    keys = [f"exchange_{n}{c}" for n in fleets for c in ("", "_complete")]
    for name in keys:
        med[name] = {k: statistics.median(r[name][k] for r in rounds)
                                for k in ("publish_us", "apply_us", "bytes_per_event", "queued_bytes_per_batch",
                                          "queued_replicas", "share_round_us", "complete_batches", "delta_batches",
                                          "complete_batch_bytes", "delta_batch_bytes")}
    record = med["route_shared_us"] - med["route_alone_us"]
    per_request_k2 = {name.removeprefix("exchange_"): record + med[name]["publish_us"] / 2 + med[name]["apply_us"] / 2
                      for name in keys}
    return {"config": vars(args), "rounds": rounds, "median": med, "record_us": record,
            "per_request_us_2_routers": per_request_k2}


def plot(out: dict, path: Path) -> None:
    """Per fleet size: a router of two's µs per request and the median batch bytes, as
    changes against every batch complete (``run``'s medians)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report_files import save_figure

    fleets = [int(x) for x in out["config"]["replicas"].split(",")]
    med, per = out["median"], out["per_request_us_2_routers"]
    xs = range(len(fleets))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for off, (suffix, label) in enumerate((("", "changes (shipped)"), ("_complete", "every batch complete"))):
        pos = [x + (off - 0.5) * 0.38 for x in xs]
        a.bar(pos, [per[f"{n}{suffix}"] for n in fleets], width=0.38, label=label)
        key = "delta_batch_bytes" if not suffix else "complete_batch_bytes"
        b.bar(pos, [med[f"exchange_{n}{suffix}"][key] for n in fleets], width=0.38, label=label)
    for ax, title in ((a, "router of two: exchange CPU per request (µs)"), (b, "median batch (bytes)")):
        ax.set_xticks(list(xs), [f"{n} replicas" for n in fleets])
        ax.set_title(title)
        ax.legend()
    b.set_yscale("log")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--replicas", default="4,64,1024", help="fleet sizes for the apply cost")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = asyncio.run(run(args))
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        args.json.write_text(text + "\n")
        plot(out, args.json.with_suffix(".png"))
    print(json.dumps({"median": out["median"], "record_us": out["record_us"],
                      "per_request_us_2_routers": out["per_request_us_2_routers"]}, indent=1))


if __name__ == "__main__":
    main()
