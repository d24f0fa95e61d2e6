"""The arms of the live A/B: which router fronts the vLLM servers, in front of which
servers, and how each router is started, probed and stopped (bench/live_ab.py).

Arms 1-3 are this project's router (``unicache router`` with ``--backend``, a subprocess);
arms 4-6 are the routers its users would pick instead, each with its documented command
line and cache-aware policy, from a virtual environment of their own
(``.peer-venv`` at the checkout's root) that ``--install-peers`` makes: they are never dependencies of this
project. Peers see vLLM's own eviction order (they cannot send UniCache's request class).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from unicache.plumbing.redis_server import free_port
from bench.paths import REPO

PEER_VENV = REPO / ".peer-venv"  # NOTE: not under bench/, whose every .py file the suite test indexes
SALT_SECRET = "live-ab"


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm. ``eviction``: the servers it fronts (``unicache``: UniCache inside vLLM;
    None: vLLM's own order). ``policy``: our router's ``--routing-policy``, or a peer's
    ``--policy`` (None: ``cache_aware``). ``sim``: the (router, eviction policy) the
    simulator predicts it with."""

    name: str
    eviction: str | None
    policy: str | None = None
    peer: str | None = None
    sim: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer router: its pinned requirement, the distribution and entry point it installs,
    and how its command line starts (the rest is common: host, port, worker URLs,
    ``--policy`` (the arm's, else ``cache_aware``), a free Prometheus port)."""

    requirement: str
    dist: str
    entry: tuple[str, ...]  # relative to the venv: a console script, or bin/python -m module
    module: str | None = None  # the import it needs where entry is ``bin/python -m``


ARMS: dict[str, Arm] = {
    "ours": Arm("ours", eviction="unicache", policy="cache_aware", sim=("cache_aware", "unicache")),
    "ours-lru": Arm("ours-lru", eviction=None, policy="cache_aware", sim=("cache_aware", "lru")),
    "round-robin": Arm("round-robin", eviction=None, policy="round_robin", sim=("round_robin", "lru")),
    "vllm-router": Arm("vllm-router", eviction=None, peer="vllm-router"),
    "sglang-router": Arm("sglang-router", eviction=None, peer="sglang-router"),
    "smg": Arm("smg", eviction=None, peer="smg"),
    # a peer's round robin beside ours: what the path costs apart from the policy
    "vllm-router-rr": Arm("vllm-router-rr", eviction=None, policy="round_robin", peer="vllm-router"),
}

PEERS: dict[str, Peer] = {
    "vllm-router": Peer("vllm-router==0.1.17", "vllm_router", ("bin/vllm-router",)),
    "sglang-router": Peer("sglang-router==0.3.2", "sglang_router", ("bin/python", "-m", "sglang_router.launch_router"),
                          module="sglang_router"),
    "smg": Peer("smg==1.13.0", "smg", ("bin/smg", "launch")),
}


def install_hint(name: str) -> str:
    return f"python -m bench.live_ab --install-peers {name}"


def peer_version(name: str, venv: Path) -> str | None:
    """The installed version of peer ``name`` in ``venv`` (None when it is not there)."""
    dist = PEERS[name].dist
    found = glob.glob(str(venv / "lib" / "python*" / "site-packages" / f"{dist}-*.dist-info"))
    if not found or not (venv / PEERS[name].entry[0]).exists():
        return None
    return Path(found[0]).name[len(dist) + 1: -len(".dist-info")]


def missing_peers(arms: list[str], venv: Path) -> list[str]:
    """The one-line refusals for the peers of ``arms`` that ``venv`` lacks."""
    return [f"live_ab: arm {a} needs {PEERS[ARMS[a].peer].requirement} in {venv}, which does not have it; "
            f"install it with: {install_hint(a)}"
            for a in arms if ARMS[a].peer and peer_version(ARMS[a].peer, venv) is None]


def install_peers(names: list[str], venv: Path) -> dict[str, str]:
    """Create ``venv`` if needed and pip-install each peer into it, one at a time (a peer
    that fails to install is reported, the others still go in); name -> version or the
    failure's last line."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    out = {}
    for name in names:
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                            PEERS[name].requirement], capture_output=True, text=True)
        version = peer_version(name, venv)
        out[name] = version if r.returncode == 0 and version else f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return out


class Router:
    """One router process in front of ``urls``; ``url`` is where requests go."""

    def __init__(self, arm: Arm, backends: list[str], urls: list[str], model_dir: str, served: str, block_size: int,
                 keys: dict[str, str], venv: Path, log_path: str, extra_args: tuple[str, ...] = (), priority: int = 0):
        """``extra_args``: more flags for this router (ours only; later flags win);
        ``priority``: the router process's nice value (every thread it starts inherits it)."""
        self.arm, self.port = arm, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.n = len(urls)
        env = dict(os.environ)
        if arm.peer is None:
            tokenizer = Path(model_dir) / "tokenizer.json"
            cmd = [sys.executable, "-m", "unicache.cli.main", "router", "--grpc-port", "0", "--http-port", str(self.port),
                   "--block-size", str(block_size), "--served-model-name", served, "--use-redis", "false",
                   "--routing-policy", arm.policy, "--log-level", "warning",
                   *(["--tokenizer", str(tokenizer)] if tokenizer.exists() else ["--checkpoint", model_dir])]
            for i, b in enumerate(backends):
                cmd += ["--backend", f"{b},id=s{i}"]
            cmd += list(extra_args)
            env |= {"UNICACHE_API_KEYS": ",".join(f"{k}:{t}" for t, k in keys.items()), "UNICACHE_SALT_SECRET": SALT_SECRET}
        else:
            peer = PEERS[arm.peer]
            cmd = [str(venv / peer.entry[0]), *peer.entry[1:], "--host", "127.0.0.1", "--port", str(self.port),
                   "--worker-urls", *urls, "--policy", arm.policy or "cache_aware", "--prometheus-port", str(free_port())]
        self.cmd = cmd
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, priority)) if priority else None)

    def wait_ready(self, model: str, key: str, timeout_s: float = 120.0) -> None:
        """Until the router knows every server (ours: ``/v1/cluster/state``) and a one-word
        completion through it answers 200."""
        deadline = time.monotonic() + timeout_s
        body = {"model": model, "prompt": "ready", "max_tokens": 1, "temperature": 0}
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.arm.name}: the router exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                known = True
                if self.arm.peer is None:
                    known = len(httpx.get(f"{self.url}/v1/cluster/state", timeout=5).json().get("replicas", [])) == self.n
                if known and httpx.post(f"{self.url}/v1/completions", json=body, timeout=30,
                                        headers={"authorization": f"Bearer {key}"}).status_code == 200:
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.arm.name}: not ready within {timeout_s:.0f} s: {' '.join(self.cmd)}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()
