"""``unicache up`` end to end: ready line, a request through the router, clean shutdown.

Runs the real command in its own session with a private TMPDIR, so the test can check
that SIGTERM leaves no process of that session, no listening port and no temp file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from unicache.testing.procfs import session_pids as _session_pids

READY = re.compile(r"^ready grpc=(\S+) http=(\S+) replicas=(\d+)$")


def _port_open(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_up_serves_then_sigterm_leaves_nothing_behind():
    # A short private TMPDIR: Ray's unix sockets live under it (107-byte path cap).
    tmpdir = Path(tempfile.mkdtemp(prefix="uc-test-", dir="/tmp"))
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicache.cli.main", "up", "--replicas", "1", "--grpc-port", "0", "--http-port", "0",
         "--num-blocks", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    match = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            match = READY.match(lines[-1])
            if match:
                break
        assert match, "no ready line:\n" + "\n".join(lines)
        while not lines[-1].startswith("Ctrl-C"):  # the endpoint listing follows the ready line
            lines.append(proc.stdout.readline().rstrip("\n"))
        grpc_addr, http_url, n = match.group(1), match.group(2), int(match.group(3))
        assert n == 1
        # Greedy: OpenAI's default temperature 1 could sample the EOS before the 4th token.
        body = json.dumps({"model": "unicache-default", "prompt": "hello " * 40, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{http_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
            assert resp.headers["x-unicache-replica"] == "replica-0"
        assert out["usage"]["completion_tokens"] == 4
        # The banner lists the replica's metrics endpoint; it counted exactly that request.
        metrics_url = next(l.split("metrics ")[-1] for l in lines if l.strip().startswith("replica replica-0"))
        with urllib.request.urlopen(metrics_url, timeout=30) as resp:
            scraped = resp.read().decode()
        prompt_line = next(l for l in scraped.splitlines() if l.startswith("vllm:prompt_tokens_total{"))
        assert float(prompt_line.split()[-1]) == out["usage"]["prompt_tokens"]
        demo = subprocess.run(
            [sys.executable, "-m", "unicache.cli.main", "demo", "--router", grpc_addr, "--sessions", "1", "--turns", "2",
             "--templated", "2", "--single", "1", "--max-tokens", "2"],
            capture_output=True, text=True, timeout=120, env=env,
        )
        assert demo.returncode == 0, demo.stderr
        all_row = next(l for l in demo.stdout.splitlines() if l.startswith("all "))
        assert all_row.split()[1] == "5"  # 2 session turns + 2 templated + 1 one-off
        assert "replica-0" in demo.stdout
        redis_addr = next(l.split()[-1] for l in lines if l.strip().startswith("redis"))
        redis_hostport = redis_addr.removeprefix("redis://").removesuffix("/0")
        assert _session_pids(proc.pid), "the cluster runs in the test's session"

        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        for _ in range(50):  # Ray's worker processes exit asynchronously after shutdown
            if not _session_pids(proc.pid):
                break
            time.sleep(0.2)
        assert _session_pids(proc.pid) == []
        assert not _port_open(grpc_addr)
        assert not _port_open(http_url.removeprefix("http://"))
        assert not _port_open(redis_hostport)
        assert list(tmpdir.iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["starting", "serving"])
def test_ctrl_c_to_the_whole_process_group_stops_quietly(moment):
    """A terminal's Ctrl-C sends SIGINT to every process of the foreground group: Redis and
    Ray's processes too, unless ``unicache up`` shields them (local_cluster.py). Sent while
    Ray and the replicas start, or once serving: exit 0, no traceback, nothing left."""
    tmpdir = Path(tempfile.mkdtemp(prefix="uc-test-", dir="/tmp"))
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicache.cli.main", "up", "--replicas", "1", "--grpc-port", "0", "--http-port", "0",
         "--num-blocks", "256", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    lines: list[str] = []
    try:
        # "starting": Redis is up and Ray starting (the Ctrl-C is held until ray.init
        # returns, then stops the start); "serving": after the endpoint listing.
        marker = "started redis-server" if moment == "starting" else "Ctrl-C stops everything."
        for line in proc.stdout:  # bounded by the test's timeout
            lines.append(line.rstrip("\n"))
            if marker in line:
                break
        assert proc.poll() is None, "\n".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out = "\n".join(lines) + "\n" + rest
        assert proc.returncode == 0, out
        assert "Traceback" not in out and "never retrieved" not in out, out
        for _ in range(50):
            if not _session_pids(proc.pid):
                break
            time.sleep(0.2)
        assert _session_pids(proc.pid) == []
        assert list(tmpdir.iterdir()) == [], [str(p) for p in tmpdir.rglob("*")][:20]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.slow
def test_up_with_the_vllm_engine_stopped_by_sigterm_leaves_nothing_behind(tmp_path):
    """vLLM's engine core is a process of its own under the replica actor: SIGTERM to
    ``unicache up --engine vllm`` must end it too (one was seen left behind after 60 s)."""
    from unicache.testing.tiny_hf_model import write_tiny_llama

    model = write_tiny_llama(str(tmp_path / "tiny-llama"))
    tmpdir = Path(tempfile.mkdtemp(prefix="uc-test-", dir="/tmp"))
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicache.cli.main", "up", "--engine", "vllm", "--model", model, "--block-size", "32",
         "--replicas", "1", "--grpc-port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        match = None
        while time.monotonic() < deadline and match is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            match = READY.match(lines[-1])
        assert match, "no ready line:\n" + "\n".join(lines)
        http_url = match.group(2)
        body = json.dumps({"model": "tiny-llama", "prompt": "w1 w2 w3 w4 " * 20, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{http_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        engine_procs = [p for p in _session_pids(proc.pid) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert engine_procs, "vLLM's engine core runs as its own process"
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        for _ in range(100):
            if not _session_pids(proc.pid):
                break
            time.sleep(0.2)
        assert _session_pids(proc.pid) == []
        assert not any(os.path.exists(f"/proc/{p}") and "EngineCore" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
                       for p in engine_procs)
        assert list(tmpdir.iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)
