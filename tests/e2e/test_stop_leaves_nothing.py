"""``unicache up`` stopped by SIGTERM to its leader or by a terminal's Ctrl-C (SIGINT to the
whole process group): one second after the leader exits, no process of its session is
alive, neither one of the descendants seen just before the stop. With the built-in engine
and with ``--engine vllm`` (a tiny seeded model, vLLM's engine core and worker processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from unicache.plumbing.process_tree import Proc, alive, descendants
from unicache.testing.procfs import session_processes as _session

READY = re.compile(r"^ready grpc=(\S+) http=(\S+) replicas=(\d+)$")


def _up(args: list[str], tmpdir: Path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "unicache.cli.main", "up", "--replicas", "1", "--grpc-port", "0", "--http-port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )


def _serve_then_stop(args: list[str], model: str, how: str, want_cmd: str) -> None:
    # A short private TMPDIR: Ray's unix sockets live under it (107-byte path cap).
    tmpdir = Path(tempfile.mkdtemp(prefix="uc-stop-", dir="/tmp"))
    proc = _up(args, tmpdir)
    lines: list[str] = []
    try:
        http_url = None
        for line in proc.stdout:  # bounded by the test's timeout
            lines.append(line.rstrip("\n"))
            if m := READY.match(lines[-1]):
                http_url = m.group(2)
            if lines[-1].startswith("Ctrl-C stops everything."):
                break
        assert http_url and proc.poll() is None, "\n".join(lines)
        body = json.dumps({"model": model, "prompt": "w1 w2 w3 w4 " * 20, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{http_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        tree: list[Proc] = descendants(proc.pid)
        assert any(want_cmd in cmd for _, cmd in _session(proc.pid)), _session(proc.pid)

        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        else:  # a terminal's Ctrl-C reaches every process of the foreground group
            os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
        exited = time.monotonic()
        assert proc.returncode == 0, rest
        assert "Traceback" not in rest, rest
        time.sleep(max(0.0, exited + 1.0 - time.monotonic()))
        assert _session(proc.pid) == []
        assert [p.pid for p in tree if alive(p)] == []
        assert list(tmpdir.iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid, _ in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_builtin_engine_cluster_leaves_no_process_a_second_after_the_leader(how):
    _serve_then_stop(["--num-blocks", "256"], "unicache-default", how, "ray::ReplicaActor")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_vllm_engine_cluster_leaves_no_process_a_second_after_the_leader(how, tmp_path):
    from unicache.testing.tiny_hf_model import write_tiny_llama

    model = write_tiny_llama(str(tmp_path / "tiny-llama"))
    _serve_then_stop(["--engine", "vllm", "--model", model, "--block-size", "32"], "tiny-llama", how, "VLLM::EngineCore")
