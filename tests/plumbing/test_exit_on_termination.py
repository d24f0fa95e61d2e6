"""A benchmark killed by SIGTERM or SIGHUP runs its ``finally`` blocks (and so stops the
vLLM servers it started in sessions of their own): ``exit_on_termination``."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import sys, time
from unicache.testing.vllm_servers import exit_on_termination
exit_on_termination()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    with open(sys.argv[1], "w") as f:
        f.write("stopped")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_benchmark_killed_by_a_termination_signal_runs_its_finally_and_exits_128_plus_the_signal(tmp_path, sig):
    marker = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marker)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text() == "stopped"
