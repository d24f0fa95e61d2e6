"""Replica settings (flag > UNICACHE_<NAME> > default) and the ``unicache replica`` process:
it prints its address, answers health, publishes a heartbeat and, on SIGTERM, stops with
exit code 0 and deletes its heartbeat."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from unicache.contract.redis_keys import RedisKeys
from unicache.plumbing.errors import UsageError
from unicache.replica.settings import ReplicaSettings, add_settings_arguments, settings_from_args
from unicache.testing.signed_state import CLUSTER_KEY

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    return p.parse_args(argv)


def test_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("UNICACHE_BLOCK_SIZE", "32")
    monkeypatch.setenv("UNICACHE_NUM_BLOCKS", "77")
    monkeypatch.setenv("UNICACHE_REDIS_PREFIX", "envp")
    monkeypatch.delenv("UNICACHE_EVICTION_POLICY", raising=False)
    s = settings_from_args(parse(["--num-blocks", "12", "--redis-url", "redis://h:1/0"]))
    assert (s.block_size, s.num_blocks, s.redis_prefix, s.redis_url, s.eviction_policy) == (32, 12, "envp", "redis://h:1/0", "unicache")
    cfg = s.engine_config()
    assert (cfg.block_size, cfg.num_blocks, cfg.checkpoint, cfg.tokenizer) == (32, 12, None, None)


def test_bad_env_value_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("UNICACHE_PORT", "eighty")
    with pytest.raises(UsageError, match="UNICACHE_PORT: port must be int, got 'eighty'"):
        settings_from_args(parse([]))


def test_config_file_sits_between_env_and_default(monkeypatch, tmp_path):
    cfg = tmp_path / "replica.yaml"
    cfg.write_text("num-blocks: 99\nblock_size: 8\neviction_policy: lru\n")
    monkeypatch.setenv("UNICACHE_BLOCK_SIZE", "32")
    monkeypatch.delenv("UNICACHE_NUM_BLOCKS", raising=False)
    monkeypatch.delenv("UNICACHE_EVICTION_POLICY", raising=False)
    s = settings_from_args(parse(["--config", str(cfg)]))
    assert (s.num_blocks, s.block_size, s.eviction_policy) == (99, 32, "lru")
    cfg.write_text("colour: red\n")
    with pytest.raises(UsageError, match="unknown setting 'colour'"):
        settings_from_args(parse(["--config", str(cfg)]))


def test_advertised_host():
    assert ReplicaSettings(host="127.0.0.1").advertised_host() == "127.0.0.1"
    assert ReplicaSettings(host="0.0.0.0", advertise_host="10.1.2.3").advertised_host() == "10.1.2.3"


@pytest.mark.slow
def test_unicache_replica_process_serves_and_stops_on_sigterm(redis_server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICACHE_")}
    env.update(UNICACHE_REDIS_URL=redis_server.url, UNICACHE_REDIS_PREFIX="clitest", UNICACHE_NUM_BLOCKS="64",
               UNICACHE_CLUSTER_KEY=CLUSTER_KEY, UNICACHE_INSECURE_NO_TLS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicache.cli.main", "replica", "--replica-id", "c0", "--device", "cpu", "--eviction-policy", "lru"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    r = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        line = proc.stdout.readline()
        assert line.startswith("replica c0 serving on 127.0.0.1:") and line.rstrip().endswith("(cpu)"), line
        address = line.split()[4]
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="unicache.v1.Replica"), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        key = RedisKeys("clitest").heartbeat("c0")
        end = time.monotonic() + 20
        while not r.exists(key):
            assert time.monotonic() < end, "no heartbeat"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not r.exists(key)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        r.close()
