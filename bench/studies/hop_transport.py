"""The router -> replica hop's transport (issue 17): what grpc.aio costs the router per
stream against the lightest transport asyncio offers, a framed byte stream.

The router's side of the hop only: a client process opens ``--concurrency`` streams at a
time to a server process, each stream one request and ``--tokens`` response messages, and
this process's CPU per stream is measured (``time.process_time``), in interleaved rounds,
medians over rounds; the servers run in their own processes, so their CPU is not in it.

    * ``grpc``: the gRPC path, ``ReplicaClients.generate`` (one grpc.aio channel per
      replica, the replica's messages read as ``RouterGenerateResponse``) against the
      project's fake replica (``unicache.testing.fake_replica``).
    * ``framed``: the same request and response protobuf bytes over one TCP connection
      per replica (``FramedClient``: frames of ``stream id, kind, length`` then the
      payload; one reader task per connection hands each stream its messages through a
      queue), against an asyncio server that answers as the fake replica does.
    * ``hop``: production's framed hop (``unicache/hop.py``: ``ReplicaClients.generate``
      to a replica advertising one, the mutual handshake with a cluster key, a deadline
      and cancellation per stream), against the same fake replica's ``HopServer``.

All carry exactly the same messages; what differs is HTTP/2, grpc core and grpc.aio's
per-call machinery against a 9-byte header per frame. No deadline, cancellation, flow
control or authentication travels in ``framed``: it is the floor ``hop`` sits above, and
``hop / framed`` is what those cost.

    .venv/bin/python -m bench.studies.hop_transport [--streams 2000] [--concurrency 64]
        [--tokens 8] [--rounds 5] [--event-loop asyncio|uvloop] [--out bench/results/hop_transport]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import struct
import time
from pathlib import Path

from unicache.v1 import common_pb2, replica_pb2, router_pb2

RESULTS = Path(__file__).resolve().parents[1] / "results"
KINDS = ("grpc", "framed", "hop")
HOP_KEY = bytes(range(32))  # the hop's handshake runs as in production (any key will do)
HEADER = struct.Struct("!IBI")  # stream id, kind, payload length
REQUEST, MESSAGE, END = 0, 1, 2


def response_bytes(tokens: int) -> list[bytes]:
    """The fake replica's messages for a stream of ``tokens`` tokens (the last carries
    usage, as the fake replica's does)."""
    out = []
    for i in range(tokens):
        msg = replica_pb2.GenerateResponse(index=0, token_ids=[65 + i % 26], text=chr(65 + i % 26))
        if i == tokens - 1:
            msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
            msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=64, completion_tokens=tokens))
        out.append(msg.SerializeToString())
    return out


# ---------------------------------------------------------------------- framed transport
async def framed_server(port_q, stop, tokens: int) -> None:
    payloads = response_bytes(tokens)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                sid, _kind, n = HEADER.unpack(head)
                replica_pb2.GenerateRequest.FromString(await reader.readexactly(n))
                for p in payloads:
                    writer.write(HEADER.pack(sid, MESSAGE, len(p)) + p)
                    await writer.drain()
                writer.write(HEADER.pack(sid, END, 0))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_q.put(server.sockets[0].getsockname()[1])
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    server.close()


class FramedClient:
    """Streams multiplexed over one connection: ``generate`` sends a request frame and
    yields the stream's messages as ``RouterGenerateResponse`` until its end frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.queues: dict[int, asyncio.Queue] = {}
        self.next_id = 0
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: int) -> FramedClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def _read(self) -> None:
        reader, queues, parse = self.reader, self.queues, router_pb2.RouterGenerateResponse.FromString
        while True:
            sid, kind, n = HEADER.unpack(await reader.readexactly(HEADER.size))
            q = queues.get(sid)
            if kind == END:
                if q is not None:
                    q.put_nowait(None)
                continue
            payload = await reader.readexactly(n)
            if q is not None:
                q.put_nowait(parse(payload))

    async def generate(self, request: replica_pb2.GenerateRequest):
        self.next_id += 1
        sid = self.next_id
        q = self.queues[sid] = asyncio.Queue()
        body = request.SerializeToString()
        self.writer.write(HEADER.pack(sid, REQUEST, len(body)) + body)
        try:
            while (msg := await q.get()) is not None:
                yield msg
        finally:
            del self.queues[sid]

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()


# ---------------------------------------------------------------------- the processes
def grpc_server_main(port_q, stop) -> None:
    async def run() -> None:
        from unicache.testing.fake_replica import FakeReplica

        class Quiet(FakeReplica):
            def __init__(self):
                super().__init__("r0")
                self.requests = []

            async def outputs(self, request):
                async with contextlib.aclosing(super().outputs(request)) as outputs:
                    async for msg in outputs:
                        yield msg
                self.requests.clear()  # a long run would hold every request

        fake = Quiet()
        await fake.start(hop=True, cluster_key=HOP_KEY)
        port_q.put((fake.port, fake.hop.port))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await fake.stop()

    asyncio.run(run())


def framed_server_main(port_q, stop, tokens: int) -> None:
    asyncio.run(framed_server(port_q, stop, tokens))


def request(tokens: int) -> replica_pb2.GenerateRequest:
    req = replica_pb2.GenerateRequest(request_id="q")
    req.token_ids.ids.extend(range(65, 65 + 64))
    req.sampling.max_tokens = tokens
    return req


async def run_streams(open_stream, streams: int, concurrency: int, tokens: int) -> tuple[float, int]:
    """CPU seconds of this process for ``streams`` streams, ``concurrency`` at a time;
    messages received."""
    sem = asyncio.Semaphore(concurrency)
    received = 0

    async def one() -> None:
        nonlocal received
        async with sem:
            async for _msg in open_stream():
                received += 1

    c0 = time.process_time()
    await asyncio.gather(*(one() for _ in range(streams)))
    return time.process_time() - c0, received


async def measure(kind: str, port: int, args) -> dict:
    req = request(args.tokens)
    if kind in ("grpc", "hop"):
        from unicache.router.replica_client import ReplicaClients

        clients = ReplicaClients(cluster_key=HOP_KEY)
        grpc_port, hop_port = port
        address, hop_address = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{hop_port}" if kind == "hop" else ""

        async def open_stream():
            stream = clients.generate(address, req, None, hop_address, "r0")
            msg = await stream.first()
            while msg is not None:
                yield msg
                msg = await stream.next()

        await run_streams(open_stream, 50, args.concurrency, args.tokens)  # warm the channel
        cpu, got = await run_streams(open_stream, args.streams, args.concurrency, args.tokens)
        await clients.close()
    else:
        client = await FramedClient.connect(port)

        def open_stream():
            return client.generate(req)

        await run_streams(open_stream, 50, args.concurrency, args.tokens)
        cpu, got = await run_streams(open_stream, args.streams, args.concurrency, args.tokens)
        await client.close()
    if got != args.streams * args.tokens:
        raise RuntimeError(f"{kind}: {got} messages, expected {args.streams * args.tokens}")
    return {"cpu_ms_per_stream": 1e3 * cpu / args.streams, "us_per_message": 1e6 * cpu / got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--event-loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--out", type=Path, default=RESULTS / "hop_transport")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ports = {}
    procs = []
    for kind, target, extra in (("grpc", grpc_server_main, ()), ("framed", framed_server_main, (args.tokens,))):
        q = ctx.Queue()
        p = ctx.Process(target=target, args=(q, stop, *extra), daemon=True)
        p.start()
        procs.append(p)
        ports[kind] = q.get(timeout=60)
    ports["hop"] = ports["grpc"]  # the fake replica serves both
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.install()
    rounds = []
    try:
        for r in range(args.rounds):
            order = KINDS[r % 3:] + KINDS[: r % 3]
            rounds.append({kind: asyncio.run(measure(kind, ports[kind], args)) for kind in order})
            print(f"round {r + 1}: " + ", ".join(f"{k} {v['cpu_ms_per_stream']:.3f} ms" for k, v in rounds[-1].items()),
                  flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
    med = {k: {m: statistics.median(rd[k][m] for rd in rounds) for m in ("cpu_ms_per_stream", "us_per_message")}
           for k in KINDS}
    ratios = {f"{a}_over_{b}": statistics.median(rd[a]["cpu_ms_per_stream"] / rd[b]["cpu_ms_per_stream"] for rd in rounds)
              for a, b in (("framed", "grpc"), ("hop", "grpc"), ("hop", "framed"))}
    report = {"command": "python -m bench.studies.hop_transport " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "rounds": rounds, "median": med,
              **ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# The replica hop's transport: grpc.aio, a framed TCP floor, and the production framed hop (issue 17)", "",
             f"`{report['command']}` ({report['cpus']} CPUs, load average {report['load_average'][0]:.2f} at the end); "
             "the client process's CPU (the router's side of the hop), medians over interleaved rounds.", "",
             "| transport | CPU ms / stream | CPU us / message |", "|---|---|---|"]
    for k in KINDS:
        lines.append(f"| {k} | {med[k]['cpu_ms_per_stream']:.3f} | {med[k]['us_per_message']:.1f} |")
    lines += [""] + [f"{k.replace('_over_', ' / ')}, median of per-round ratios: {v:.3f}" for k, v in ratios.items()] + [""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
