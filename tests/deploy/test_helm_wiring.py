"""The chart's containers, run for real on this machine with the settings the chart
renders: the Redis container's arguments and password file against a real redis-server,
the launcher's readiness probe against heartbeats in Redis, and the router started with
the chart's environment (Secret values, $(VAR) expansion, API keys file) answering HTTP.
Only hostnames, ports and mount paths are replaced by local ones.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import helm_python as helm
import httpx
import pytest
import redis

from unicache.contract.redis_keys import RedisKeys
from unicache.plumbing.redis_server import EmbeddedRedis, RedisTls, find_redis_binary, free_port
from tests.support import strict_yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "unicache"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render({}, name="uc", namespace="serving", is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in strict_yaml.safe_load_all(text) if d]


def pick(docs, kind: str, component: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return doc


def secret_data(docs, component: str) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in pick(docs, "Secret", component)["data"].items()}


def tls_dir(docs, tmp_path: Path) -> Path:
    """The chart's generated TLS Secret (secret-tls.yaml) written out, one file per entry."""
    d = tmp_path / "tls"
    d.mkdir()
    for key, value in secret_data(docs, "tls").items():
        (d / key).write_text(value)
        (d / key).chmod(0o600)
    return d


def chart_redis(docs, tmp_path: Path) -> EmbeddedRedis:
    """A redis-server as the chart runs it: its generated password, TLS only on the
    chart's certificate."""
    d = tls_dir(docs, tmp_path)
    tls = RedisTls(str(d / "redis.crt"), str(d / "redis.key"), str(d / "ca.crt"))
    return EmbeddedRedis(password=secret_data(docs, "redis")["redis-password"], tls=tls)


def container_environment(docs, container: dict, overrides: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env
    in order (secretKeyRef resolved from the rendered Secrets, $(VAR) expanded), then
    ``overrides`` for what only makes sense in the cluster (hostnames, mount paths)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        env.update(cm["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    env.update(overrides)
    return env


def test_redis_container_runs_with_its_args_and_generated_password(docs, tmp_path):
    """redis-server accepts the StatefulSet's arguments and mounted redis.conf; the
    readiness probe passes only with the password; the URL the router and launcher get
    (password embedded) authenticates."""
    container = pick(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    secrets = secret_data(docs, "redis")
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    for key, value in secrets.items():
        (secret_dir / key).write_text(value)
    tls = tls_dir(docs, tmp_path)
    port = free_port()
    args = [a.replace("/etc/redis/secret", str(secret_dir)).replace("/etc/redis/tls", str(tls)) for a in container["args"]]
    assert args[args.index("--port") + 1] == "0"  # TLS only
    args[args.index("--tls-port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    assert container["command"] == ["redis-server"]
    proc = subprocess.Popen([find_redis_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        probe = container["readinessProbe"]["exec"]["command"]
        script = (probe[2].replace("/etc/redis/secret", str(secret_dir)).replace("/etc/redis/tls", str(tls))
                  .replace("-h 127.0.0.1", f"-h 127.0.0.1 -p {port}"))
        deadline = time.monotonic() + 10
        while subprocess.run([probe[0], probe[1], script], capture_output=True).returncode != 0:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "redis never turned ready"
            time.sleep(0.1)
        (secret_dir / "redis-password").write_text("wrong")
        assert subprocess.run([probe[0], probe[1], script], capture_output=True).returncode != 0
        router = pick(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
        env = container_environment(docs, router, {})
        url = env["UNICACHE_REDIS_URL"]
        local = url.replace("uc-unicache-redis.serving.svc:6379", f"127.0.0.1:{port}")
        assert local == f"rediss://:{secrets['redis-password']}@127.0.0.1:{port}/0"
        assert env["UNICACHE_REDIS_TLS_CA"] == "/etc/unicache/redis-tls/ca.pem"  # the Secret's ca.crt
        client = redis.Redis.from_url(local, socket_timeout=2, ssl_ca_certs=str(tls / "ca.crt"))
        assert client.ping() is True
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""}
        client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2, ssl=True, ssl_ca_certs=str(tls / "ca.crt")).ping()
        with pytest.raises(redis.ConnectionError):  # no plain-text port
            redis.Redis(port=port, socket_timeout=2).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_launcher_readiness_waits_for_every_replica_heartbeat(docs, tmp_path):
    redis_server = chart_redis(docs, tmp_path)
    redis_server.start()
    container = pick(docs, "Deployment", "launcher")["spec"]["template"]["spec"]["containers"][0]
    ca = redis_server.tls.ca_file
    env = container_environment(docs, container, {"UNICACHE_REDIS_URL": redis_server.url, "UNICACHE_REDIS_TLS_CA": ca})
    assert env["PROBE_EXPECTED_REPLICAS"] == "2"
    probe = container["readinessProbe"]["exec"]["command"]
    command = [sys.executable if probe[0] == "python" else probe[0], *probe[1:]]

    def ready() -> bool:
        return subprocess.run(command, env={**os.environ, **env}, capture_output=True, timeout=30).returncode == 0

    keys = RedisKeys(env["UNICACHE_REDIS_PREFIX"])
    client = redis.Redis.from_url(redis_server.url, ssl_ca_certs=ca)
    try:
        assert not ready()
        client.set(keys.heartbeat("uc-replica-0"), b"hb", ex=30)
        client.set(RedisKeys("other-cluster").heartbeat("x-0"), b"hb", ex=30)  # another prefix does not count
        assert not ready()
        client.set(keys.heartbeat("uc-replica-1"), b"hb", ex=30)
        assert ready()
    finally:
        client.close()
        redis_server.close()


def test_router_starts_with_the_charts_environment(docs, tmp_path):
    """The router process, given exactly the chart's settings, serves /healthz, reports
    not-ready without replicas, and accepts the generated API key (and only it)."""
    server = chart_redis(docs, tmp_path)
    server.start()
    tls = Path(server.tls.ca_file).parent
    proc = None
    try:
        container = pick(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
        keys_file = tmp_path / "api-keys"
        keys_file.write_text(secret_data(docs, "secrets")["api-keys"])
        # The mounted TLS files at local paths: the router's (replica-tls) and Redis's CA (redis-tls).
        env = container_environment(docs, container, {
            "UNICACHE_API_KEYS_FILE": str(keys_file), "UNICACHE_REDIS_TLS_CA": str(tls / "ca.crt"),
            "UNICACHE_REPLICA_TLS_CA": str(tls / "ca.crt"), "UNICACHE_REPLICA_TLS_CERT": str(tls / "router.crt"),
            "UNICACHE_REPLICA_TLS_KEY": str(tls / "router.key"),
        })
        assert "UNICACHE_INSECURE_NO_TLS" not in env
        env["UNICACHE_REDIS_URL"] = env["UNICACHE_REDIS_URL"].replace(
            "uc-unicache-redis.serving.svc:6379", f"127.0.0.1:{server.port}"
        )
        env["UNICACHE_GRPC_HOST"] = env["UNICACHE_HTTP_HOST"] = "127.0.0.1"
        grpc_port, http_port = free_port(), free_port()
        args = list(container["args"])
        args[args.index("--grpc-port") + 1] = str(grpc_port)
        args[args.index("--http-port") + 1] = str(http_port)
        proc = subprocess.Popen(
            [sys.executable, "-m", "unicache.cli.main", *args],
            env={**os.environ, **env}, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                health = httpx.get(base + "/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "router never answered /healthz"
                time.sleep(0.2)
        assert health.status_code == 200
        assert health.json()["replicas"] == 0
        assert httpx.get(base + "/readyz", timeout=5).status_code == 503
        key = keys_file.read_text().split()[0].rpartition(":")[0]
        ok = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
        assert ok.status_code == 200
        assert [m["id"] for m in ok.json()["data"]] == ["unicache-default"]
        bad = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer not-a-key"}, timeout=5)
        assert bad.status_code == 401
        deadline = time.monotonic() + 10  # the subscriber connects with the embedded password
        while httpx.get(base + "/healthz", timeout=5).json()["redis_connected"] is not True:
            assert time.monotonic() < deadline, "router never connected to Redis"
            time.sleep(0.2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)
        server.close()
