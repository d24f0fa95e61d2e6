"""Redis is always authenticated: the embedded server's password stays off command lines
and in private files; ``rediss://`` with a CA works end to end against a real TLS
redis-server (self-signed CA made with openssl for the test)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import redis

from unicache.contract.redis_keys import RedisKeys
from unicache.plumbing.redis_server import EmbeddedRedis, RedisTls, write_private
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import KVStore
from unicache.replica.publishing.publisher import CachePublisher
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.subscriber import RedisSubscriber
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.baselines.round_robin import RoundRobinPolicy
from unicache.testing.polling import eventually
from unicache.testing.signed_state import SIGNER
from unicache.testing.store_source import StoreCacheSource

PW = "embedded-PW-7c1d0e"
PREFIX = "rtls"


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_password_is_not_on_redis_servers_command_line(tmp_path):
    server = EmbeddedRedis(password=PW)
    server.start()
    try:
        # NOTE: redis-server rewrites its process title once up, so check both the argv it
        # was started with and what /proc shows now.
        assert PW not in " ".join(server.proc.args)
        assert PW.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        conf = server.proc.args[1]
        assert conf.endswith("redis.conf") and _mode(conf) == 0o600 and _mode(os.path.dirname(conf)) == 0o700
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.plain_url, socket_timeout=2).ping()
        assert redis.Redis.from_url(server.plain_url, password=PW, socket_timeout=2).ping() is True
        pw_file = server.write_password_file(str(tmp_path / "redis.password"))
        assert Path(pw_file).read_text() == PW and _mode(pw_file) == 0o600
    finally:
        server.close()


def test_write_private_replaces_a_file_with_mode_0600(tmp_path):
    path = tmp_path / "k"
    path.write_text("old")
    path.chmod(0o644)
    write_private(str(path), "new")
    assert path.read_text() == "new" and _mode(str(path)) == 0o600


def test_local_cluster_key_file_is_private():
    from unicache.cli.local_cluster import ClusterSettings, LocalCluster

    cluster = LocalCluster(ClusterSettings())
    try:
        assert _mode(cluster.cluster_key_file) == 0o600 and _mode(os.path.dirname(cluster.cluster_key_file)) == 0o700
        assert Path(cluster.cluster_key_file).read_text() == cluster.cluster_key and len(cluster.cluster_key) == 64
    finally:
        cluster.stop_backends()
    assert not os.path.exists(cluster.cluster_key_file)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_files(tmp_path) -> RedisTls:
    """A CA and a server certificate for 127.0.0.1 signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=unicache-test-ca", cwd=tmp_path)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=tmp_path)
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "1", "-extfile", "san.ext", cwd=tmp_path)
    return RedisTls(str(tmp_path / "server.pem"), str(tmp_path / "server.key"), str(tmp_path / "ca.pem"))


async def test_rediss_with_ca_end_to_end(tls_files):
    """A replica's publisher and a router's subscriber both reach a TLS-only, password
    protected redis-server through ``rediss://`` + CA; without the CA the TLS handshake
    fails, and plain ``redis://`` gets no answer."""
    server = EmbeddedRedis(password=PW, tls=tls_files)
    server.start()
    url = server.plain_url
    assert url.startswith("rediss://")
    src = StoreCacheSource(KVStore(8, 4, make_policy("lru")), device="cpu")
    pub = CachePublisher(
        src, "r0", url, "127.0.0.1:5000", RedisKeys(PREFIX), heartbeat_interval_s=0.05, password=PW,
        tls_ca=tls_files.ca_file, signer=SIGNER, op_timeout_s=5.0,  # TLS handshakes on a busy box
    )
    cluster = ClusterView(RoundRobinPolicy(), LocalityIndex())

    async def from_the_replica(address, nonce, timeout_s):  # noqa: ARG001
        return await pub.signed_summary(nonce)

    sub = RedisSubscriber(
        cluster, url, PREFIX, password=PW, tls_ca=tls_files.ca_file, heartbeat_interval_s=0.0, timeout_s=5.0,
        signer=SIGNER, fetch_summary=from_the_replica,
    )
    try:
        await pub.start()
        await eventually(lambda: pub.resync_needed is False, "publisher to reach Redis over TLS")

        async def admitted():
            await sub.step(block_ms=0)
            return "r0" in cluster.replicas

        await eventually(admitted, "router to admit r0 over TLS")
        assert cluster.redis_connected and sub.rejections.total() == 0
        with pytest.raises(redis.ConnectionError):  # the server's CA is not in the system store
            redis.Redis.from_url(url, password=PW, socket_timeout=2).ping()
        with pytest.raises(redis.ConnectionError):  # TLS only: no plain-text port
            redis.Redis.from_url(url.replace("rediss://", "redis://"), password=PW, socket_timeout=2).ping()
    finally:
        await pub.stop()
        await sub.close()
        server.close()
