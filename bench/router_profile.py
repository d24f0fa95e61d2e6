"""Router CPU per request: bursts of concurrent streams against cheap fake replicas, with
the router in its own process (optionally under cProfile), so the router's own cost is
what the figures show.

Processes: the fake replicas (``unicache.testing.fake_replica.FakeReplica``: echo, one token
per message, no model) share one process; the router (round robin, no auth, no Redis, as
in ``bench/load_test.py``) has its own; this process is the client. Each round sends the
burst straight to the replicas, then through each front door: the router; with
``--baseline-unicache EXE`` the ``unicache router`` command of another checkout's venv,
on each of ``--event-loops`` (A/B in the same run: e.g. ``git worktree add /tmp/base <commit>``, a venv there with
that checkout installed, and ``--baseline-unicache /tmp/base/.venv/bin/unicache``); with
``--bare`` a bare grpc.aio forwarding proxy (the floor any grpc.aio router pays).

The figure to compare is CPU seconds per request of each front door's process (all
threads, from /proc), as a ratio to the replicas' CPU per direct request and, per round,
router / baseline and router / bare proxy. req/s ratios are reported too but swing with
other jobs on a shared host. ``--profile`` adds the router's top functions (cProfile of
its event-loop thread over the router bursts only).

    .venv/bin/python -m bench.router_profile [--requests 1000] [--max-tokens 8] [--step-ms 0] [--rounds 3]
        [--bare] [--baseline-unicache EXE] [--event-loops asyncio,uvloop] [--transports grpc,hop] [--profile] [--top 40]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from unicache.testing.procfs import cpu_s
from bench.load_test import burst, join_children
from bench.rounds import round_order


# (front door, reference): per-round CPU ratios reported for each pair present.
PAIRS = (
    ("router_hop", "router"), ("router_hop_uvloop", "router_uvloop"), ("router_hop", "bare_proxy"),
    ("router_hop_uvloop", "bare_proxy_uvloop"),
    ("router", "router_baseline"), ("router_uvloop", "router_baseline_uvloop"), ("router", "bare_proxy"),
    ("router_uvloop", "bare_proxy_uvloop"),
    ("router_uvloop", "router"), ("bare_proxy_uvloop", "bare_proxy"),
)


def replicas_main(n: int, ports, stop, served=None, step_s: float = 0.0) -> None:
    """``n`` fake replicas in this process until ``stop`` is set; their (gRPC, hop) ports
    go to ``ports``. With ``served`` (a shared int) they count the streams they answered and
    keep no request (a client that cannot read gRPC trailers is checked by the count).
    ``step_s``: tokens in engine steps of that length (``FakeReplica``), 0: all at once."""

    async def run() -> None:
        from unicache.testing.fake_replica import FakeReplica

        class Counting(FakeReplica):
            async def outputs(self, request):
                async with contextlib.aclosing(super().outputs(request)) as outputs:
                    async for msg in outputs:
                        yield msg
                with served.get_lock():
                    served.value += 1

        fakes = [(FakeReplica if served is None else Counting)(f"r{i}", step_s=step_s) for i in range(n)]
        for f in fakes:
            if served is not None:
                f.requests = _Discard()  # a long run would hold every request
            await f.start(hop=True)
        ports.put(("replicas", [(f.port, f.hop.port) for f in fakes], os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for f in fakes:
            await f.stop()

    asyncio.run(run())


def replica_spec(rep_ports: list[tuple[int, int]], hop: bool = False) -> str:
    """``--replicas`` of the fake replicas (``replicas_main``'s (gRPC port, hop port)
    pairs); ``hop`` adds each one's framed hop (``id=host:port@host:hop_port``)."""
    return ",".join(f"r{i}=127.0.0.1:{p}" + (f"@127.0.0.1:{h}" if hop else "") for i, (p, h) in enumerate(rep_ports))


class _Discard(list):
    """A list that keeps nothing appended to it."""

    def append(self, item) -> None:
        pass


async def start_bare_proxy(addresses: list[str], metadata=None):
    """The floor: a grpc.aio ``Router.Generate`` that only forwards (round robin, the
    prompt's UTF-8 bytes as token ids, replica messages passed on as bytes; no auth, no
    hashing, no classification, no metrics; ``metadata``: a function giving what each replica call
    carries, e.g. the cluster credential's). Returns (server, port, channels)."""
    import itertools

    import grpc

    from unicache.v1 import replica_pb2, router_pb2

    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    calls = itertools.cycle([
        c.unary_stream("/unicache.v1.Replica/Generate", request_serializer=replica_pb2.GenerateRequest.SerializeToString,
                       response_deserializer=None)
        for c in channels
    ])

    async def generate(request, context):
        fwd = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=request.text.encode()), sampling=request.sampling)
        async for raw in next(calls)(fwd, timeout=300, metadata=metadata() if metadata else None):
            yield raw

    handler = grpc.unary_stream_rpc_method_handler(
        generate, request_deserializer=router_pb2.RouterGenerateRequest.FromString, response_serializer=None
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("unicache.v1.Router", {"Generate": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, channels


def router_main(spec: str, profile_path: str | None, ports, cmds, stop, bare: bool = False, event_loop: str = "asyncio") -> None:
    """The router (``bare``: the bare proxy) on ``event_loop``; with ``profile_path``,
    cProfile runs while the client says "on"."""
    loop_name = event_loop

    async def run() -> None:
        import cProfile

        from unicache.router.app import RouterApp
        from unicache.router.config import build_config

        cfg = build_config(env={}, overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False,
            "routing_policy": "round_robin", "replicas": spec, "event_loop": loop_name,
        })
        if bare:
            server, port, channels = await start_bare_proxy([a.split("=", 1)[1].split("@")[0] for a in spec.split(",")])
        else:
            app = RouterApp(cfg)
            await app.start()
            port = app.grpc_port
        prof = cProfile.Profile() if profile_path else None
        ports.put(("router", port, os.getpid()))
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, cmds.get)
            if cmd == "stop":
                break
            if prof is not None:
                prof.enable() if cmd == "on" else prof.disable()
            ports.put(("ack", cmd))
        if prof is not None:
            prof.dump_stats(profile_path)
        if bare:
            await server.stop(0)
            for c in channels:
                await c.close()
        else:
            await app.stop()

    from unicache.router.frontends.http_server import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        runner.run(run())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_baseline(exe: str, spec: str, timeout_s: float = 60.0, extra_env: dict[str, str] | None = None
                   ) -> tuple[subprocess.Popen, int, int]:
    """``EXE router`` (another checkout's ``unicache`` command) with this bench's router
    settings, as environment variables (the settings interface every checkout shares;
    ``extra_env`` adds more, e.g. ``UNICACHE_EVENT_LOOP``), run from an empty folder so
    nothing in this tree shadows that checkout's package. Returns the process and its
    gRPC and HTTP ports once the gRPC port accepts a channel."""
    import grpc

    port, http_port = free_port(), free_port()
    env = dict(os.environ, UNICACHE_GRPC_PORT=str(port), UNICACHE_HTTP_PORT=str(http_port), UNICACHE_USE_REDIS="false",
               UNICACHE_AUTH_ENABLED="false", UNICACHE_ROUTING_POLICY="round_robin", UNICACHE_REPLICAS=spec)
    env.update(extra_env or {})
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([exe, "router", "--log-level", "warning"], env=env, cwd=tempfile.mkdtemp())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            proc.kill()
            raise RuntimeError(f"{exe} router did not listen on port {port} within {timeout_s:g} s") from None
    return proc, port, http_port


async def drive(args, rep_ports: list[tuple[int, int]], front: dict[str, tuple[int, int]], rep_pid: int, ports, cmds,
                profiled: str = "router") -> dict:
    """Rounds of: the burst direct, then through each front door (``front``: name ->
    (port, pid)); cProfile (if on) is enabled only around the ``profiled`` door's bursts."""
    import grpc

    from unicache.v1 import replica_pb2_grpc, router_pb2_grpc

    loop = asyncio.get_running_loop()

    async def say(cmd: str) -> None:
        cmds.put(cmd)
        await loop.run_in_executor(None, ports.get)

    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p, _ in rep_ports]
    fchans = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (port, _) in front.items()}
    direct = [replica_pb2_grpc.ReplicaStub(c) for c in chans]
    stubs = {name: [router_pb2_grpc.RouterStub(c)] for name, c in fchans.items()}
    await burst(direct, 100, args.max_tokens, True)  # warm up every path
    for stub in stubs.values():
        await burst(stub, 100, args.max_tokens, False)
    rounds = []
    for _ in range(args.rounds):
        # CPU per request: the replicas' process serving the direct burst (one gRPC server
        # side per stream) is the baseline; a front door serves a stream and calls a replica.
        c0 = cpu_s(rep_pid)
        d = await burst(direct, args.requests, args.max_tokens, True)
        d["cpu_ms_per_request"] = round(1e3 * (cpu_s(rep_pid) - c0) / args.requests, 3)
        rnd = {"direct": d}
        # NOTE: the order turns every round, so no front door always follows the same one.
        names = round_order(list(stubs), len(rounds))
        for name in names:
            stub = stubs[name]
            if name == profiled:
                await say("on")
            c0, rc0 = cpu_s(front[name][1]), cpu_s(rep_pid)
            r = await burst(stub, args.requests, args.max_tokens, False)
            r["cpu_ms_per_request"] = round(1e3 * (cpu_s(front[name][1]) - c0) / args.requests, 3)
            # the replicas' side of the hop this front door uses (gRPC server or framed hop)
            r["replicas_cpu_ms_per_request"] = round(1e3 * (cpu_s(rep_pid) - rc0) / args.requests, 3)
            if name == profiled:
                await say("off")
            r["ratio_req_per_s"] = round(r["requests_per_s"] / d["requests_per_s"], 3)
            r["ratio_cpu_per_request"] = round(r["cpu_ms_per_request"] / d["cpu_ms_per_request"], 3)
            rnd[name] = r
        bad = {n: (p["ok"], p["errors"], p["malformed_answers"]) for n, p in rnd.items()
               if p["ok"] != args.requests or p["malformed_answers"]}
        assert not bad, f"phases with failed or malformed answers (ok, errors, malformed): {bad}"
        for name, ref in PAIRS:
            if name in rnd and ref in rnd:
                rnd[name][f"ratio_cpu_vs_{ref}"] = round(rnd[name]["cpu_ms_per_request"] / rnd[ref]["cpu_ms_per_request"], 3)
        rounds.append(rnd)
    for c in [*chans, *fchans.values()]:
        await c.close()
    med = lambda name, key: round(statistics.median(x[name][key] for x in rounds), 3)  # noqa: E731
    keys = ("cpu_ms_per_request", "ratio_cpu_per_request", "ratio_req_per_s", "requests_per_s", "replicas_cpu_ms_per_request")
    median = {name: {k: med(name, k) for k in keys} for name in front}
    for name, ref in PAIRS:
        if name in front and ref in front:
            median[name][f"ratio_cpu_vs_{ref}"] = med(name, f"ratio_cpu_vs_{ref}")
    return {
        "config": {"requests": args.requests, "max_tokens": args.max_tokens, "replicas": args.replicas, "rounds": args.rounds, "step_ms": args.step_ms,
                   "transports": args.transports,
                   "cpus": os.cpu_count(), "baseline_unicache": args.baseline_unicache,
                   "load_average_1m": round(os.getloadavg()[0], 2)},
        "rounds": rounds,
        "median": median,
    }


def profile_report(path: str, top: int) -> str:
    import pstats

    out = io.StringIO()
    st = pstats.Stats(path, stream=out)
    st.strip_dirs()
    for key in ("tottime", "cumulative"):
        out.write(f"\n=== router, by {key} ===\n")
        st.sort_stats(key).print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="run the router under cProfile (slows it; ratios then mean less)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--bare", action="store_true", help="also measure a bare forwarding proxy (the grpc.aio floor)")
    ap.add_argument("--baseline-unicache", metavar="EXE",
                    help="also measure `EXE router`: the unicache command of another checkout's venv")
    ap.add_argument("--event-loops", default="asyncio",
                    help="comma-separated loops each in-process front door runs on (asyncio, uvloop): "
                         "router_uvloop, bare_proxy_uvloop are the uvloop runs")
    ap.add_argument("--transports", default="grpc",
                    help="comma-separated replica hops the router is measured on: grpc (front door 'router'), "
                         "hop (the framed hop, unicache/contract/hop.py: 'router_hop')")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the fake replicas make tokens in engine steps of this length, one per running stream "
                         "per step (default 0: a stream's tokens at once)")
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    routers = [{"grpc": "router", "hop": "router_hop"}[t] for t in args.transports.split(",")]
    doors = [(name + ("" if loop == "asyncio" else f"_{loop}"), name == "bare_proxy", loop)
             for loop in args.event_loops.split(",") for name in routers + ["bare_proxy"] * args.bare]
    cmds = {name: ctx.Queue() for name, _, _ in doors}  # each in-process front door's own
    prof_path = os.path.join(tempfile.mkdtemp(), "router.prof") if args.profile else None
    reps = ctx.Process(target=replicas_main, args=(args.replicas, ports, stop, None, args.step_ms / 1000.0))
    reps.start()
    children = [reps]
    baselines: list[subprocess.Popen] = []
    front: dict[str, tuple[int, int]] = {}
    try:
        _, rep_ports, rep_pid = ports.get(timeout=60)
        spec, hop_spec = replica_spec(rep_ports), replica_spec(rep_ports, hop=True)
        for name, bare, loop in doors:
            prof = prof_path if name == routers[0] else None
            door_spec = hop_spec if name.startswith("router_hop") else spec
            proc = ctx.Process(target=router_main, args=(spec if bare else door_spec, prof, ports, cmds[name], stop, bare, loop))
            proc.start()
            children.append(proc)
            _, port, pid = ports.get(timeout=60)
            front[name] = (port, pid)
        if args.baseline_unicache:
            for loop in args.event_loops.split(","):
                proc, port, _ = start_baseline(args.baseline_unicache, spec, extra_env={"UNICACHE_EVENT_LOOP": loop})
                baselines.append(proc)
                front["router_baseline" + ("" if loop == "asyncio" else f"_{loop}")] = (port, proc.pid)
        result = asyncio.run(drive(args, rep_ports, front, rep_pid, ports, cmds[routers[0]], routers[0]))
    finally:
        stop.set()
        for q in cmds.values():
            q.put("stop")
        for proc in baselines:
            proc.terminate()
            proc.wait(timeout=30)
        join_children(children)
    for i, rnd in enumerate(result["rounds"]):
        d = rnd["direct"]
        line = f"round {i}: direct {d['requests_per_s']} req/s, replicas CPU {d['cpu_ms_per_request']} ms/req"
        for name in front:
            r = rnd[name]
            line += (f" | {name} {r['requests_per_s']} req/s ({r['ratio_req_per_s']}x), "
                     f"CPU {r['cpu_ms_per_request']} ms/req ({r['ratio_cpu_per_request']}x)")
        print(line)
    for name, m in result["median"].items():
        print(f"median {name}: CPU {m['cpu_ms_per_request']} ms/req = {m['ratio_cpu_per_request']}x the replicas' CPU per "
              f"direct request; req/s {m['requests_per_s']} = {m['ratio_req_per_s']}x direct; replicas' CPU behind it "
              f"{m['replicas_cpu_ms_per_request']} ms/req")
    for name, ref in PAIRS:
        if name in front and ref in front:
            print(f"median per-round {name} CPU / {ref} CPU: {result['median'][name][f'ratio_cpu_vs_{ref}']} "
                  f"(rounds: {[r[name][f'ratio_cpu_vs_{ref}'] for r in result['rounds']]})")
    if prof_path:
        print(profile_report(prof_path, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
