"""Authentication is on by default: ``unicache router`` without keys refuses to start with a
one-line error unless auth is explicitly disabled; ``unicache up`` runs its local router
without auth unless ``--api-keys`` is given."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from unicache.cli.local_cluster import ClusterSettings, LocalCluster
from unicache.cli.main import main
from unicache.router.config import RouterConfig


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNICACHE_"):
            monkeypatch.delenv(name)


def test_auth_is_on_by_default():
    assert RouterConfig().auth_enabled is True


def test_router_without_keys_refuses_to_start(clean_env, capsys):
    assert main(["router", "--grpc-port", "0", "--http-port", "0", "--use-redis", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "unicache router: error: auth is enabled but no API keys are configured (set UNICACHE_API_KEYS or "
        "--api-keys-file, or pass --auth-enabled false to serve every request as tenant 'default')"
    )


def test_router_with_keys_but_no_salt_secret_refuses_to_start(clean_env, capsys, monkeypatch):
    monkeypatch.setenv("UNICACHE_API_KEYS", "sk-live-123:acme")
    assert main(["router", "--grpc-port", "0", "--http-port", "0", "--use-redis", "false"]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines()[-1] == (
        "unicache router: error: auth is enabled but no salt secret is configured (set UNICACHE_SALT_SECRET or --salt-secret)"
    )
    assert "sk-live-123" not in out.err + out.out


def test_router_starts_when_auth_is_explicitly_disabled(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICACHE_")}
    cmd = [sys.executable, "-m", "unicache.cli.main", "router", "--auth-enabled", "false", "--use-redis", "false",
           "--grpc-port", "0", "--http-port", "0"]
    log = tmp_path / "router.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "router serving gRPC" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.1)
        assert "'auth_enabled': False" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def start_up_router(redis_url: str, **kw) -> LocalCluster:
    cluster = LocalCluster(ClusterSettings(grpc_port=0, http_port=0, redis_url=redis_url, **kw))
    await cluster.start_router()
    return cluster


async def test_up_local_mode_has_no_auth(redis_server):
    cluster = await start_up_router(redis_server.url)
    try:
        assert cluster.router.auth.enabled is False
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.router.http_port}", timeout=10) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503  # past auth: no replica (none were started)
            assert (await c.get("/v1/models")).status_code == 200
    finally:
        await cluster.stop_router()
        cluster.stop_backends()


async def test_up_with_api_keys_requires_them(redis_server):
    cluster = await start_up_router(redis_server.url, api_keys="sk-up-1:acme")
    try:
        assert cluster.router.auth.enabled is True
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.router.http_port}", timeout=10) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "missing API key"
            r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer sk-up-2"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
            assert "sk-up" not in r.text
            r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer sk-up-1"})
            assert r.status_code == 503  # authenticated; no replica
    finally:
        await cluster.stop_router()
        cluster.stop_backends()
