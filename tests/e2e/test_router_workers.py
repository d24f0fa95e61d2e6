"""``unicache router --workers N``: N processes sharing the ports and the cluster's view.

Real processes: the supervisor and its workers (``unicache router`` subprocess), a private
redis-server, and two fake replicas served from this test's event loop. Checks which
process holds which socket through /proc (Linux), so "shares the ports" means: every
worker holds a listening socket on the gRPC port and on the HTTP port, and connections
opened by clients land on more than one worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.procfs import child_pids
from unicache.testing.signed_state import CLUSTER_KEY
from unicache.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

UNICACHE = [sys.executable, "-m", "unicache.cli.main"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_sockets() -> dict[int, tuple[int, str]]:
    """inode -> (local port, state hex) of every TCP socket (grpc listens on IPv6 sockets
    with v4-mapped addresses)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            out[int(f[9])] = (int(f[1].rsplit(":", 1)[1], 16), f[3])
    return out


def sockets_of(pid: int) -> list[tuple[int, str]]:
    """(local port, state) of the TCP sockets process ``pid`` holds."""
    table = tcp_sockets()
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in table:
                out.append(table[inode])
    return out


LISTEN, ESTABLISHED = "0A", "01"


async def wait_http(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router exited with {proc.returncode}"
        try:
            async with httpx.AsyncClient() as c:
                if (await c.get(f"http://127.0.0.1:{port}/healthz", timeout=1)).status_code in (200, 503):
                    return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"router HTTP port {port} did not answer within {timeout_s:g} s")


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"router did not exit within {timeout_s:g} s of SIGTERM") from None


async def test_two_workers_share_both_ports_and_keep_sessions_together(redis_server):
    fakes = [FakeReplica(f"r{i}") for i in range(2)]
    for f in fakes:
        await f.start()
    gport, hport = free_port(), free_port()
    env = dict(os.environ, UNICACHE_CLUSTER_KEY=CLUSTER_KEY, UNICACHE_INSECURE_NO_TLS="1", UNICACHE_API_KEYS="k:acme", UNICACHE_SALT_SECRET="x")
    proc = subprocess.Popen(
        [*UNICACHE, "router", "--workers", "2", "--grpc-port", str(gport), "--http-port", str(hport), "--tokenizer", "byte",
         "--redis-url", redis_server.url, "--redis-prefix", "workers", "--replicas", ",".join(f"{f.replica_id}={f.address}" for f in fakes),
         "--log-level", "warning"],
        env=env,
    )
    try:
        await wait_http(hport, proc)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers

        def listening(pid: int) -> set[int]:
            return {port for port, state in sockets_of(pid) if state == LISTEN}

        # each worker listens on both shared ports (the second may still be starting)
        await eventually(lambda: all({gport, hport} <= listening(p) for p in workers), "both workers listening")
        assert not [s for s in sockets_of(proc.pid) if s[1] == LISTEN]  # the supervisor serves nothing

        # Sessions over many connections: each turn on a new HTTP connection, alternating
        # with gRPC turns on fresh channels, so the kernel spreads them over the workers.
        held = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=30) for _ in range(16)]
        for c in held:
            assert (await c.get("/healthz")).status_code in (200, 503)
        spread = {pid: sum(1 for port, st in sockets_of(pid) if port == hport and st == ESTABLISHED) for pid in workers}
        assert sum(spread.values()) == 16 and all(spread.values()), spread
        for c in held:
            await c.aclose()

        homes: dict[int, set[str]] = {s: set() for s in range(12)}
        prompts = {s: f"session {s} opens. " * 4 for s in range(12)}
        for turn in range(4):
            for s in range(12):
                prompts[s] += f"turn {turn} of {s}. "
                if (s + turn) % 2:
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=30) as c:
                        r = await c.post("/v1/completions", json={"prompt": prompts[s], "max_tokens": 2},
                                         headers={"x-api-key": "k", "x-session-id": f"s{s}"})
                    assert r.status_code == 200, r.text
                    homes[s].add(r.headers["x-unicache-replica"])
                else:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as ch:
                        req = router_pb2.RouterGenerateRequest(text=prompts[s], session_id=f"s{s}",
                                                               sampling=common_pb2.SamplingParams(max_tokens=2))
                        msgs = [m async for m in router_pb2_grpc.RouterStub(ch).Generate(req, metadata=[("x-api-key", "k")], timeout=30)]
                    homes[s].add(msgs[0].route.replica_id)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert stop(proc) == 0
        assert not [p for p in workers if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in fakes:
            await f.stop()


def test_workers_need_fixed_ports():
    r = subprocess.run([*UNICACHE, "router", "--workers", "2", "--grpc-port", "0", "--use-redis", "false",
                        "--auth-enabled", "false", "--replicas", "r0=127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--workers > 1 needs fixed --grpc-port and --http-port" in r.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_router_exits_on_sigterm(loop):
    """Under uvloop the router once hung on SIGTERM (grpc.aio bound to another loop)."""
    hport = free_port()
    proc = subprocess.Popen([*UNICACHE, "router", "--event-loop", loop, "--grpc-port", str(free_port()), "--http-port", str(hport),
                             "--use-redis", "false", "--auth-enabled", "false", "--replicas", "r0=127.0.0.1:1", "--log-level", "warning"])
    try:
        await wait_http(hport, proc)
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
