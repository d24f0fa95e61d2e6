"""The replica as a Ray actor: launch one through the launcher, generate over gRPC, kill it
with restart allowed and see it come back (same id, new process, new epoch), stop cleanly.

One in-process ``ray.init`` for the whole module (Ray start is slow on 2 cores).
"""

from __future__ import annotations

import time

import grpc
import pytest
import ray
import redis

from unicache.contract.redis_keys import RedisKeys
from unicache.replica.actor import ACTOR_NAMESPACE, actor_name, actor_options
from unicache.replica.launcher import ReplicaLauncher, wait_healthy
from unicache.replica.settings import ReplicaSettings
from unicache.testing.signed_state import CLUSTER_KEY, SIGNER, call_metadata
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc

pytestmark = pytest.mark.slow
KEYS = RedisKeys("actortest")
PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def generate(address: str) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = replica_pb2_grpc.ReplicaStub(ch)
        req = replica_pb2.GenerateRequest(
            token_ids=replica_pb2.TokenIds(ids=PROMPT), sampling=common_pb2.SamplingParams(max_tokens=4)
        )
        return [t for m in stub.Generate(req, timeout=60, metadata=call_metadata()) for t in m.token_ids]


def heartbeat(r: redis.Redis, rid: str) -> cache_pb2.Heartbeat | None:
    raw = r.get(KEYS.heartbeat(rid))
    return cache_pb2.Heartbeat.FromString(SIGNER.open("hb", raw)) if raw else None


def info_or_none(handle) -> dict | None:
    try:
        return ray.get(handle.info.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def wait_until(pred, timeout_s: float = 60.0):
    end = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.1)


def test_actor_options_restart_forever_and_pick_gpu_or_cpu():
    cpu = actor_options("r1", use_gpu=False)
    gpu = actor_options("r1", use_gpu=True)
    assert (cpu["max_restarts"], cpu["num_gpus"], cpu["num_cpus"], cpu["name"]) == (-1, 0, 1, "unicache-replica-r1")
    assert (gpu["num_gpus"], gpu["namespace"]) == (1, ACTOR_NAMESPACE)


def test_launch_generate_kill_restart_stop(ray_local, redis_server):
    r = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    base = ReplicaSettings(redis_url=redis_server.url, redis_prefix=KEYS.prefix, num_blocks=64, block_size=8, eviction_policy="lru",
                           cluster_key=CLUSTER_KEY, insecure_no_tls=True)
    launcher = ReplicaLauncher(base, num=1, id_prefix="t", use_gpu=False, start_timeout_s=120)
    try:
        [rep] = launcher.start()
        assert rep.replica_id == "t-0" and rep.address.startswith("127.0.0.1:") and rep.device == "cpu"
        tokens = generate(rep.address)
        assert len(tokens) == 4
        hb = wait_until(lambda: heartbeat(r, "t-0"))
        assert (hb.address, hb.device, hb.cache.capacity_blocks, hb.cache.block_size) == (rep.address, "cpu", 64, 8)
        before = ray.get(rep.handle.info.remote(), timeout=30)
        assert ray.get_actor(actor_name("t-0"), namespace=ACTOR_NAMESPACE) is not None

        ray.kill(rep.handle, no_restart=False)
        # ray.kill is asynchronous: poll until a new process answers (same handle, same name).
        after = wait_until(lambda: (i := info_or_none(rep.handle)) is not None and i["pid"] != before["pid"] and i, 120)
        assert after["replica_id"] == "t-0"
        assert after["epoch"] > before["epoch"]
        wait_healthy(after["address"], timeout_s=60)
        assert generate(after["address"]) == tokens  # same seeded model, greedy
        hb = wait_until(lambda: (h := heartbeat(r, "t-0")) is not None and h.epoch == after["epoch"] and h)
        assert hb.address == after["address"]
    finally:
        launcher.stop()
    assert heartbeat(r, "t-0") is None  # clean stop deletes the heartbeat at once
    with pytest.raises(ValueError):
        ray.get_actor(actor_name("t-0"), namespace=ACTOR_NAMESPACE)
    r.close()
