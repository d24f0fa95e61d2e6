"""Mutual TLS by default: a router or replica holding the cluster key but no TLS files
refuses to start, naming the fix, unless the named opt-out ``insecure_no_tls`` is set; the
opt-out is logged at every start and exported as ``unicache_{router,replica}_insecure_transport``."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from unicache.cli.main import main
from unicache.plumbing.errors import UsageError
from unicache.plumbing.tls import make_cluster_pki
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.signed_state import CLUSTER_KEY

REFUSAL = (
    "the router has a cluster key but no mutual TLS: set replica_tls_ca, replica_tls_cert and replica_tls_key (files from "
    "the cluster CA; `unicache up` and the Helm chart make them), or set insecure_no_tls (--insecure-no-tls true, "
    "UNICACHE_INSECURE_NO_TLS=1) to run without it (what that gives up: docs/security.md)"
)
STATIC = {"grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False, "replicas": "r0=127.0.0.1:9"}


def router(env: dict[str, str], **overrides) -> RouterApp:
    return RouterApp(build_config(env=env, overrides={**STATIC, **overrides}))


def gauge(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_a_router_with_the_key_and_no_tls_refuses_to_start():
    with pytest.raises(UsageError) as err:
        router({"UNICACHE_CLUSTER_KEY": CLUSTER_KEY})
    assert str(err.value) == REFUSAL


def test_the_cli_says_the_same_in_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("UNICACHE_CLUSTER_KEY", CLUSTER_KEY)
    code = main(["router", "--grpc-port", "0", "--http-port", "0", "--use-redis", "false", "--auth-enabled", "false",
                 "--replicas", "r0=127.0.0.1:9"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"unicache router: error: {REFUSAL}"


def test_the_opt_out_is_logged_at_every_start_and_exported(caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        app = router({"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"})
        assert gauge(app.metrics.render(app.cluster).decode(), "unicache_router_insecure_transport") == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "INSECURE" in r.getMessage()]
    assert len(warnings) == 2 and warnings[0].startswith("INSECURE: the router runs without mutual TLS (insecure_no_tls is set): ")


def test_with_tls_or_without_a_key_nothing_is_insecure(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    files, _ = make_cluster_pki(str(tmp_path), ["r0"])
    secure = router({"UNICACHE_CLUSTER_KEY": CLUSTER_KEY}, replica_tls_ca=files.ca, replica_tls_cert=files.cert, replica_tls_key=files.key)
    keyless = router({})  # no cluster key: nothing to protect it with (a vLLM-only or local router)
    for app in (secure, keyless):
        assert gauge(app.metrics.render(app.cluster).decode(), "unicache_router_insecure_transport") == 0.0
    assert not [r for r in caplog.records if "INSECURE" in r.getMessage()]
    with pytest.raises(UsageError, match="insecure_no_tls is set but so are replica_tls_ca, replica_tls_cert and replica_tls_key: drop one"):
        router({"UNICACHE_CLUSTER_KEY": CLUSTER_KEY, "UNICACHE_INSECURE_NO_TLS": "1"},
               replica_tls_ca=files.ca, replica_tls_cert=files.cert, replica_tls_key=files.key)


def replica(**kw) -> ReplicaSettings:
    return ReplicaSettings(replica_id="t0", cluster_key=CLUSTER_KEY, model_preset="tiny", num_blocks=16, device="cpu",
                           hop_port=-1, **kw)


def test_a_replica_with_the_key_and_no_tls_refuses_before_anything_starts():
    message = (
        "replica t0 has a cluster key but no mutual TLS: set tls_ca, tls_cert and tls_key (files from the cluster CA; "
        "`unicache up` and the Helm chart make them), or set insecure_no_tls (--insecure-no-tls true, "
        "UNICACHE_INSECURE_NO_TLS=1) to run without it (what that gives up: docs/security.md)"
    )
    with pytest.raises(UsageError) as err:
        replica().check()  # what `unicache replica` and the launcher run first
    assert str(err.value) == message
    runtime = ReplicaRuntime(replica())
    with pytest.raises(UsageError):
        asyncio.run(runtime.start())
    assert runtime.engine is None and runtime.server is None  # refused before the engine or a port


async def test_a_replica_under_the_opt_out_warns_and_exports_it(caplog):
    caplog.set_level(logging.WARNING)
    runtime = ReplicaRuntime(replica(insecure_no_tls=True))
    await runtime.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(runtime.metrics_url)).text
        assert gauge(text, "unicache_replica_insecure_transport") == 1.0
        assert [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()] == [
            "INSECURE: replica t0 runs without mutual TLS (insecure_no_tls is set): a process bound to a dead replica's "
            "ports is sent requests (prompts and tenant salts) and the router's bearer credential, which replays on every "
            "replica for 60 s, and a relay in front of a live replica reads every request in clear (docs/security.md)"
        ]
    finally:
        await runtime.stop()
