"""Settings are refused before anything starts: no Redis, no Ray, no replica, no traceback.

``unicache up`` with an unknown policy used to fail 30-40 s in, behind Ray's tracebacks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from unicache.cli import local_cluster
from unicache.cli.main import main
from unicache.plumbing.errors import UsageError
from unicache.replica.eviction.registry import policy_names
from unicache.replica.settings import ReplicaSettings, replica_eviction_policies
from unicache.router.config import build_config
from unicache.router.routing.registry import routing_policy_names

ROUTING = "cache_aware, least_loaded, round_robin, session_affinity, sglang"
EVICTION = "arc, fifo, lecar, lfu, lru, opt, radix-lru, s3fifo, unicache"
REPLICA_EVICTION = ", ".join(replica_eviction_policies())


@pytest.fixture
def nothing_starts(monkeypatch):
    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError("a backend started")

    monkeypatch.setattr(local_cluster.LocalCluster, "__init__", refuse)
    monkeypatch.setattr(local_cluster.LocalCluster, "start_backends", refuse)
    return started


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--routing-policy", "nope"], f"routing_policy: unknown routing policy 'nope' (choose from {ROUTING})"),
        (["--eviction-policy", "nope"], f"eviction_policy: unknown eviction policy 'nope' (choose from {EVICTION})"),
        (["--eviction-policy", "opt"], f"eviction_policy: 'opt' needs the future (simulator only); a replica runs one of {REPLICA_EVICTION}"),
        (["--block-size", "0"], "block_size must be positive, got 0"),
        (["--num-blocks", "-1"], "num_blocks must be positive, got -1"),
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--http-port", "70000"], "http_port must be 0-65535, got 70000"),
        (["--checkpoint", "/nonexistent/ckpt"], "checkpoint /nonexistent/ckpt is not a directory"),
        (["--host-blocks", "-1"], "host_blocks must be >= 0, got -1"),
        (["--host-blocks", "8", "--host-eviction-policy", "nope"],
         f"host_eviction_policy: unknown eviction policy 'nope' (choose from {EVICTION})"),
        (["--host-blocks", "8", "--host-eviction-policy", "opt"],
         f"host_eviction_policy: 'opt' needs the future (simulator only); a replica runs one of {REPLICA_EVICTION}"),
        (["--engine", "vllm", "--checkpoint", "/tmp", "--host-blocks", "8"],
         "host_blocks: the vllm engine has no host tier (vLLM 0.32.0's CPU offloading keeps its own copy policy and "
         "needs CUDA; see docs/host_tier.md); use --engine torch or --host-blocks 0"),
    ],
)
def test_up_refuses_bad_settings_before_starting_anything(argv, message, nothing_starts, capsys):
    assert main(["up", *argv]) == 2
    assert capsys.readouterr().err == f"unicache up: error: {message}\n"
    assert nothing_starts == []


def test_up_refuses_an_unknown_policy_from_the_environment_too(monkeypatch, nothing_starts, capsys):
    monkeypatch.setenv("UNICACHE_EVICTION_POLICY", "nope")
    assert main(["up"]) == 2
    assert f"(choose from {EVICTION})" in capsys.readouterr().err


def test_the_router_and_replica_settings_check_their_policies():
    with pytest.raises(UsageError, match=rf"routing_policy: unknown routing policy 'nope' \(choose from {ROUTING}\)"):
        build_config(env={}, overrides={"routing_policy": "nope"})
    assert build_config(env={}, overrides={"routing_policy": "sglang"}).routing_policy == "sglang"
    with pytest.raises(UsageError, match=r"eviction_policy: unknown eviction policy 'nope'"):
        ReplicaSettings(eviction_policy="nope").check()
    ReplicaSettings(eviction_policy="radix-lru").check()
    ReplicaSettings(host_blocks=64, host_eviction_policy="lru").check()
    assert ReplicaSettings(host_blocks=64, host_eviction_policy="lru").engine_config().host_blocks == 64


def test_unicache_replicas_refuses_a_bad_policy_before_ray(capsys, monkeypatch):
    # (a checkpoint path is the Ray workers', so the launcher leaves it to them)
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ray.init called")))
    assert main(["replicas", "--redis-url", "redis://127.0.0.1:1", "--eviction-policy", "nope"]) == 2
    assert capsys.readouterr().err.startswith("unicache replicas: error: eviction_policy: unknown eviction policy 'nope'")


def test_the_real_command_exits_with_one_line_and_no_traceback():
    out = subprocess.run([sys.executable, "-m", "unicache.cli.main", "up", "--routing-policy", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.splitlines() == [f"unicache up: error: routing_policy: unknown routing policy 'nope' (choose from {ROUTING})"]


def test_a_launcher_leaves_checkpoint_paths_to_the_workers():
    ReplicaSettings(checkpoint="/models/on-the-workers").check(local_paths=False)
    with pytest.raises(UsageError, match="checkpoint /models/on-the-workers is not a directory"):
        ReplicaSettings(checkpoint="/models/on-the-workers").check()
