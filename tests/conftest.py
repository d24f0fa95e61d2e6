"""Shared fixtures. Anything touching Redis gets its own redis-server on a free loopback port."""

from __future__ import annotations

from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait

# Before anything imports torch: spinning OpenMP threads made small CPU forwards ~100x
# slower on the shared 2-core box (cpu_env.py).
prefer_passive_omp_wait()

import secrets  # noqa: E402

import pytest  # noqa: E402

from unicache.plumbing.redis_server import EmbeddedRedis


@pytest.fixture
def redis_server():
    """A fresh password-protected redis-server on 127.0.0.1:<free port> (``.url`` carries
    the password); killed after the test.

    Tests may call ``redis_server.stop()`` / ``redis_server.start()`` to simulate an
    outage (the port stays the same).
    """
    proc = EmbeddedRedis(password=secrets.token_hex(12))
    proc.start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
async def one_replica_stack():
    """A ``LoadStack`` (router + one real in-process replica, auth keys ``API_KEYS``)."""
    from tests.support.load_stack import LoadStack

    st = await LoadStack.start(num_replicas=1)
    try:
        yield st
    finally:
        await st.close()


# Folders whose tests carry a marker, so `pytest -m "not e2e and not deploy"` is the quick
# loop: e2e starts real processes across components, deploy renders and lints the chart
# and images. The folder decides, so a test cannot sit there without the marker.
FOLDER_MARKERS = {"e2e": ("e2e", "slow"), "deploy": ("deploy",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.parts
        for folder, markers in FOLDER_MARKERS.items():
            if "tests" in parts and parts[parts.index("tests") + 1 : parts.index("tests") + 2] == (folder,):
                for name in markers:
                    item.add_marker(name)
