"""A backend process that dies: after a few tokens the client gets an OpenAI-shaped error
event and the end of the stream at once (gRPC: UNAVAILABLE), over both transports to our
replicas, counted in ``unicache_router_broken_streams_total``; one that dies before its
first token costs the client nothing: the request is served elsewhere.

The replica is a ``FakeReplica`` in a process of its own that ends itself with
``os._exit`` (no goodbye on any socket: the kernel closes them, as for a crash or a kill)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap

import grpc
import httpx
import pytest

from unicache.plumbing import grpc_server
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = "A prompt of exactly forty-eight bytes, 3 blocks."

# Serves gRPC and the framed hop; the call that finds ``die_after`` tokens sent ends the
# process (``how``: exit, or freeze: SIGSTOP, alive but silent on every socket).
DYING = textwrap.dedent("""
    import asyncio, os, signal, sys
    from unicache.testing.fake_replica import FakeReplica

    DIE_AFTER = int(sys.argv[1])
    HOW = sys.argv[2]

    class Dying(FakeReplica):
        async def outputs(self, request):
            if DIE_AFTER == 0:
                os._exit(1)
            sent = 0
            async for msg in super().outputs(request):
                yield msg
                sent += 1
                if sent == DIE_AFTER:
                    await asyncio.sleep(1.0)  # the tokens reach the router first
                    if HOW == "freeze":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    os._exit(1)

    async def main():
        rep = Dying("r0")
        await rep.start(hop=True)
        print(rep.port, rep.hop.port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


@contextlib.asynccontextmanager
async def cluster(die_after: int, transport: str, spare: bool = False, how: str = "exit"):
    """(app, the dying replica's process, the spare in-process replica r1 or None)."""
    proc = subprocess.Popen([sys.executable, "-c", DYING, str(die_after), how], stdout=subprocess.PIPE, text=True)
    r1 = FakeReplica("r1") if spare else None
    app = None
    try:
        port, hop_port = proc.stdout.readline().split()
        replicas = f"r0=127.0.0.1:{port}@127.0.0.1:{hop_port}"
        if r1 is not None:
            await r1.start()
            replicas += f",r1={r1.address}"
        cfg = build_config(env={"UNICACHE_USE_REDIS": "false"}, overrides={
            "grpc_port": 0, "http_port": 0, "replicas": replicas, "routing_policy": "round_robin", "auth_enabled": False,
            "replica_transport": transport})
        app = RouterApp(cfg)
        await app.start()
        yield app, proc, r1
    finally:
        if app is not None:
            await app.stop()
        if r1 is not None:
            await r1.stop()
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()


def broken(app: RouterApp, **labels) -> float | None:
    return app.metrics.registry.get_sample_value("unicache_router_broken_streams_total", labels)


@pytest.mark.parametrize("transport", ["grpc", "auto"])  # auto: the framed hop the replica serves
async def test_sse_stream_of_a_replica_that_dies_ends_with_an_error_event(transport):
    async with cluster(die_after=2, transport=transport) as (app, proc, _):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as client:
            body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
            resp = await client.post("/v1/completions", json=body)  # read to its end: never hung
        assert proc.wait(timeout=10) == 1
        assert resp.status_code == 200 and resp.headers["x-unicache-replica"] == "r0"
        events = [e[len("data: "):] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        # NOTE: the two tokens left the replica before it died; over the hop they may come in
        # one event, and the second was seen lost with the connection on this shared host
        # (the hop server may still have held it), so the error may follow the first alone.
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        assert text == "A " or (transport == "auto" and text == "A")
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["param"], error["code"]) == ("service_unavailable", None, "service_unavailable")
        assert error["message"].startswith("replica r0 failed after the response started (")
        assert error["message"].endswith("); the response is incomplete, retry the request")
        assert events[-1] == "[DONE]"
        assert broken(app, replica="r0", kind="unavailable") == 1
        assert not app.cluster.healthy("r0") and app.cluster.replicas["r0"].in_flight == 0


async def test_grpc_stream_of_a_replica_that_dies_ends_unavailable():
    async with cluster(die_after=2, transport="grpc") as (app, proc, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=8)), timeout=30)
            texts = [(await call.read()).text, (await call.read()).text]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
        assert texts == ["A", " "]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("replica r0 failed after the response started")
        assert broken(app, replica="r0", kind="unavailable") == 1


async def test_a_replica_that_dies_before_its_first_token_is_retried_elsewhere():
    async with cluster(die_after=0, transport="grpc", spare=True) as (app, proc, r1):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as client:
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True})
        events = [e[len("data: "):] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        assert resp.status_code == 200 and resp.headers["x-unicache-replica"] == "r1"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "A p"
        assert events[-1] == "[DONE]" and len(r1.served) == 1
        assert proc.wait(timeout=10) == 1
        assert broken(app, replica="r0", kind="unavailable") is None  # nothing was cut short


@pytest.fixture
def fast_keepalive(monkeypatch):
    """The router pings its replica channels every 0.3 s and gives up after 0.3 s silence."""
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIME_MS", 300)
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIMEOUT_MS", 300)


async def test_a_frozen_replica_mid_stream_is_found_by_keepalive_not_the_deadline(fast_keepalive):
    """SIGSTOP: the replica's sockets stay open and silent (as a host lost without closing
    them); the unanswered ping ends the stream long before the 300 s forward deadline."""
    async with cluster(die_after=2, transport="grpc", how="freeze") as (app, proc, _):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=60) as client:
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "stream": True})
        events = [e[len("data: "):] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["A", " "]
        assert json.loads(events[2])["error"]["code"] == "service_unavailable" and events[3:] == ["[DONE]"]
        assert proc.poll() is None  # still there, frozen
        assert broken(app, replica="r0", kind="unavailable") == 1


async def test_keepalive_pings_never_end_a_silent_stream_of_a_live_replica(fast_keepalive):
    rep = FakeReplica("r0")
    await rep.start()
    rep.hold = asyncio.Event()
    cfg = build_config(env={"UNICACHE_USE_REDIS": "false"}, overrides={
        "grpc_port": 0, "http_port": 0, "replicas": f"r0={rep.address}", "auth_enabled": False, "replica_transport": "grpc"})
    app = RouterApp(cfg)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.RouterGenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=30)
            assert (await call.read()).text == "A"
            await asyncio.sleep(2.0)  # silent for about 6 ping intervals: each ping is answered
            rep.hold.set()
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
        assert [m.text for m in rest] == [" ", "p"] and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert broken(app, replica="r0", kind="unavailable") is None
    finally:
        await app.stop()
        await rep.stop()
