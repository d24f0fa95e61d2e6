"""Secrets (API keys, the salt secret, the Redis password) never appear in logs, metrics,
error messages, the dashboard or the state endpoints, on the error paths that are most
likely to echo them: bad keys, bad config values, a wrong Redis password, an unreachable
Redis with the password in its URL. Also: the Redis password setting works for both the
router and the replicas' publisher against a password-protected redis-server."""

from __future__ import annotations

import logging
import os

import grpc
import httpx
import pytest

from unicache.cli.main import main
from unicache.contract.redis_keys import RedisKeys
from unicache.plumbing.redis_server import EmbeddedRedis
from unicache.plumbing.redis_server import free_port
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import KVStore
from unicache.replica.publishing.publisher import CachePublisher
from unicache.replica.settings import ReplicaSettings, add_settings_arguments
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, SIGNER
from unicache.testing.store_source import StoreCacheSource
from unicache.v1 import router_pb2, router_pb2_grpc

API_KEY = "sk-live-KEY-4f1c9e"
SALT = "salt-SECRET-77b2"
REDIS_PW = "redis-PW-91ad3"
WRONG_PW = "wrong-PW-0c5e1"
BAD_KEY = "sk-guess-ATTEMPT-5a"
SECRETS = (API_KEY, SALT, REDIS_PW, WRONG_PW, BAD_KEY, CLUSTER_KEY)
PREFIX = "sec"


def assert_clean(text: str, where: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{where} contains {leaked}"


@pytest.fixture
def protected_redis():
    proc = EmbeddedRedis(password=REDIS_PW)
    proc.start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNICACHE_"):
            monkeypatch.delenv(name)


def router_config(redis_url: str, **overrides):
    env = {"UNICACHE_API_KEYS": f"{API_KEY}:acme", "UNICACHE_SALT_SECRET": SALT, "UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"}
    base = {"grpc_port": 0, "http_port": 0, "redis_url": redis_url, "redis_prefix": PREFIX}
    base.update(overrides)
    return build_config(env=env, overrides=base)


def publisher(url: str, **kw) -> CachePublisher:
    src = StoreCacheSource(KVStore(8, 4, make_policy("lru")), device="cpu")
    return CachePublisher(
        src, "r0", url, "127.0.0.1:5000", RedisKeys(PREFIX), heartbeat_interval_s=0.05, op_timeout_s=0.5, signer=SIGNER, **kw
    )


async def scrape_everything(app: RouterApp) -> str:
    """Every unauthenticated surface plus the error bodies of bad-key requests."""
    out = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as c:
        for path in ("/metrics", "/v1/cluster/state", "/dashboard", "/healthz", "/readyz"):
            out.append((await c.get(path)).text)
        for headers in ({"authorization": f"Bearer {BAD_KEY}"}, {"x-api-key": BAD_KEY}, {}):
            r = await c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401
            out.append(r.text + str(r.headers))
        r = await c.post("/v1/completions", content=f'{{"prompt": "{SALT}'.encode(), headers={"x-api-key": API_KEY})
        assert r.status_code == 400  # malformed JSON that happens to contain a secret is not echoed
        out.append(r.text)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(text="hi"), metadata=[("x-api-key", BAD_KEY)], timeout=10)]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out.append(err.value.details() + str(err.value.trailing_metadata()))
        out.append(str(await stub.GetClusterState(router_pb2.GetClusterStateRequest(), timeout=10)))
        out.append(str(await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)))
    return "\n".join(out)


async def test_password_protected_redis_works_for_router_and_replica(protected_redis, caplog):
    """The replica publishes with ``password=`` (its new setting); the router follows with
    ``redis_password``; nothing they log or serve carries a secret."""
    caplog.set_level(logging.DEBUG)
    url = protected_redis.url.replace(f":{REDIS_PW}@", "")  # the password travels separately
    pub = publisher(url, password=REDIS_PW)
    await pub.start()
    app = RouterApp(router_config(url, redis_password=REDIS_PW), subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20})

    async def from_the_replica(address, nonce, timeout_s):  # noqa: ARG001 - r0 has no gRPC server here
        return await pub.signed_summary(nonce)

    app.subscriber.fetch_summary = from_the_replica
    await app.start()
    try:
        await eventually(lambda: "r0" in app.cluster.replicas and app.cluster.redis_connected, "router to see r0")
        assert pub.stats.heartbeats >= 1 and pub.stats.redis_errors == 0
        assert_clean(await scrape_everything(app), "router responses")
    finally:
        await app.stop()
        await pub.stop()
    # The password in the URL (what the Helm chart passes) works as well.
    pub = publisher(protected_redis.url)
    await pub.start()
    try:
        assert pub.resync_needed is False and pub.stats.redis_errors == 0
    finally:
        await pub.stop()
    assert_clean(caplog.text, "logs")


async def test_wrong_redis_password_leaks_nothing(protected_redis, caplog):
    caplog.set_level(logging.DEBUG)
    url = protected_redis.url.replace(f":{REDIS_PW}@", "")
    app = RouterApp(router_config(url, redis_password=WRONG_PW), subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20})
    pub = publisher(f"redis://:{WRONG_PW}@127.0.0.1:{protected_redis.port}/0")
    await app.start()
    await pub.start()
    try:
        await eventually(lambda: "redis unreachable" in caplog.text, "router to log the failure")
        await eventually(lambda: pub.stats.redis_errors >= 1, "publisher to fail")
        assert app.cluster.redis_connected is False and pub.resync_needed is True
        assert app.subscriber.reconnects == 0  # it never got in, so it never counted a reconnection
        assert "AuthenticationError" in caplog.text  # the log says what went wrong ...
        assert_clean(await scrape_everything(app), "router responses")
    finally:
        await pub.stop()
        await app.stop()
    assert_clean(caplog.text, "logs")  # ... but never with the password


async def test_unreachable_redis_with_password_in_url_leaks_nothing(caplog):
    caplog.set_level(logging.DEBUG)
    url = f"redis://:{REDIS_PW}@127.0.0.1:{free_port()}/0"  # nothing listens there
    cfg = router_config(url)
    assert cfg.describe()["redis_url"] == f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}"
    logging.getLogger("router").info("config: %s", cfg.describe())  # what `unicache router` logs
    app = RouterApp(cfg, subscriber_kwargs={"heartbeat_interval_s": 0.05, "block_ms": 20, "backoff_max_s": 0.1})
    pub = publisher(url)
    await app.start()
    await pub.start()
    try:
        await eventually(lambda: "redis unreachable" in caplog.text and pub.stats.redis_errors >= 1, "both to fail")
        assert "ConnectionError" in caplog.text
        assert_clean(await scrape_everything(app), "router responses")
    finally:
        await pub.stop()
        await app.stop()
    assert_clean(caplog.text, "logs")


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        # A key entry without a tenant: the key itself must not be quoted back.
        (["--api-keys", API_KEY, "--salt-secret", SALT], {}, "API key entry 1: expected 'key:tenant'"),
        # Keys from the environment, with a malformed entry after a good one.
        ([], {"UNICACHE_API_KEYS": f"{API_KEY}:acme,{BAD_KEY}", "UNICACHE_SALT_SECRET": SALT}, "API key entry 2"),
        # A config file whose YAML breaks on the line holding the secret.
        (["--config", "{dir}/bad.yaml"], {}, "cannot parse: found unexpected end of stream at line 3 column 1"),
        # A JSON keys file that does not parse.
        (["--api-keys-file", "{dir}/keys.json", "--salt-secret", SALT], {}, "bad JSON at line 1"),
        # Everything valid except the tokenizer: the config line is logged first.
        (
            ["--api-keys", f"{API_KEY}:acme", "--salt-secret", SALT, "--redis-url", f"redis://u:{REDIS_PW}@127.0.0.1:1/0",
             "--redis-password", REDIS_PW, "--tokenizer", "{dir}/missing.json"],
            {},
            "cannot load tokenizer",
        ),
        # A TLS CA without rediss://.
        (["--api-keys", f"{API_KEY}:acme", "--salt-secret", SALT, "--redis-url", f"redis://:{REDIS_PW}@h:1/0",
          "--redis-tls-ca", "/ca.pem"], {}, "redis_tls_ca needs a rediss:// redis_url"),
        # A URL that is not Redis at all.
        (["--api-keys", f"{API_KEY}:acme", "--salt-secret", SALT, "--redis-url", f"http://:{REDIS_PW}@h:1/0"], {},
         "redis_url must start with redis://"),
        # A bad value in the environment next to the secrets.
        ([], {"UNICACHE_API_KEYS": f"{API_KEY}:acme", "UNICACHE_SALT_SECRET": SALT, "UNICACHE_REDIS_PASSWORD": REDIS_PW,
              "UNICACHE_AUTH_ENABLED": "maybe"}, "UNICACHE_AUTH_ENABLED: auth_enabled must be bool, got 'maybe'"),
    ],
)
def test_cli_errors_and_logs_carry_no_secret(argv, env, expected, tmp_path, clean_env, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    (tmp_path / "bad.yaml").write_text(f'api_keys: "{API_KEY}:acme"\nsalt_secret: "{SALT}\n')
    (tmp_path / "keys.json").write_text(f'{{"{API_KEY}": "acme",')
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    code, output = run_cli(["router", "--grpc-port", "0", "--http-port", "0", *argv], capsys)
    assert code == 2
    assert expected in output
    assert_clean(output + caplog.text, "CLI output")


def test_replica_settings_treat_the_redis_password_as_secret(capsys):
    import argparse

    s = ReplicaSettings(redis_url="redis://127.0.0.1:6379/0", redis_password=REDIS_PW)
    assert REDIS_PW not in repr(s)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert REDIS_PW not in parser.format_help() and "--redis-password" in parser.format_help()
    with pytest.raises(ValueError, match="redis_tls_ca needs a rediss:// redis_url"):
        publisher("redis://127.0.0.1:1/0", tls_ca="/ca.pem")


async def test_publisher_uses_tls_ca_for_rediss():
    pub = publisher("rediss://127.0.0.1:1/0", tls_ca="/etc/ssl/ca.pem", password=REDIS_PW)
    client = pub._client()
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["ssl_ca_certs"], kwargs["password"]) == ("/etc/ssl/ca.pem", REDIS_PW)
    finally:
        await client.aclose()


async def test_router_subscriber_uses_tls_ca_for_rediss():
    cfg = router_config("rediss://127.0.0.1:1/0", redis_tls_ca="/etc/ssl/ca.pem", redis_password=REDIS_PW)
    app = RouterApp(cfg)
    try:
        kwargs = app.subscriber.redis.connection_pool.connection_kwargs
        assert (kwargs["ssl_ca_certs"], kwargs["password"]) == ("/etc/ssl/ca.pem", REDIS_PW)
    finally:
        await app.subscriber.close()


@pytest.mark.parametrize(
    "url, shown",
    [
        (f"redis://:{REDIS_PW}@h:6379/0", "redis://:***@h:6379/0"),
        (f"rediss://default:{REDIS_PW}@h:6379/0", "rediss://default:***@h:6379/0"),
        (f"redis://h:6379/0?password={REDIS_PW}&db=1", "redis://h:6379/0?password=***&db=1"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_logged_redis_url_masks_both_password_forms(url, shown):
    import redis

    assert redis.connection.parse_url(url).get("password") in (REDIS_PW, None)  # redis-py reads both forms
    assert build_config(env={}, overrides={"redis_url": url}).describe()["redis_url"] == shown


def test_replica_cli_redis_errors_carry_no_secret(clean_env, capsys, caplog, monkeypatch):
    """``unicache replica`` with a TLS CA on a plain URL holding a password: one line, no
    password; the password given as a flag works but is warned about."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("UNICACHE_CLUSTER_KEY", CLUSTER_KEY)
    monkeypatch.setenv("UNICACHE_INSECURE_NO_TLS", "1")
    argv = ["replica", "--model-preset", "tiny", "--num-blocks", "16", "--device", "cpu",
            "--redis-url", f"redis://:{REDIS_PW}@127.0.0.1:1/0", "--redis-password", REDIS_PW, "--redis-tls-ca", "/ca.pem"]
    code, output = run_cli(argv, capsys)
    assert code == 2
    lines = output.strip().splitlines()
    assert lines[-1] == "unicache replica: error: redis_tls_ca needs a rediss:// redis_url"
    assert lines.count(
        "warning: --redis-password on the command line is visible to every local user in /proc/<pid>/cmdline; "
        "set UNICACHE_REDIS_PASSWORD or UNICACHE_REDIS_PASSWORD_FILE instead"
    ) == 1
    assert_clean(output + caplog.text, "replica CLI output")
