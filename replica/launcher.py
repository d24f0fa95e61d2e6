"""Start N replica actors, wait until each answers gRPC health, stop them cleanly.

Driver-side, synchronous code (the CLI and tests call it; never from inside an event
loop). Every wait has a deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from unicache.replica.actor import ReplicaActor, actor_options
from unicache.replica.serving.server import SERVICE_NAME
from unicache.replica.settings import ReplicaSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LaunchedReplica:
    replica_id: str
    address: str
    device: str
    handle: Any  # ray.actor.ActorHandle
    metrics_url: str = ""


def wait_healthy(address: str, timeout_s: float = 30.0, call_timeout_s: float = 1.0) -> None:
    """Block until the gRPC health service at ``address`` reports SERVING (TimeoutError after
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=call_timeout_s)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica at {address} not healthy within {timeout_s}s")
            time.sleep(0.1)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


class ReplicaLauncher:
    """Launches ``num`` named replica actors ``<id_prefix>-0 .. -N-1`` from one settings template.

    Args:
        base: settings shared by all replicas (``replica_id`` is replaced per replica).
        num: number of replicas.
        id_prefix: replica ids are ``f"{id_prefix}-{i}"`` (stable across restarts).
        use_gpu: GPUs per actor (the settings' ``tensor_parallel_size``); None decides from
            the Ray cluster's resources.
        start_timeout_s: deadline for each actor to start and turn healthy (default 300 s:
            model init on a busy CPU can be slow).
        stop_timeout_s: deadline for each actor's clean shutdown before it is killed.
    """

    def __init__(
        self,
        base: ReplicaSettings,
        num: int,
        id_prefix: str = "replica",
        use_gpu: bool | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
    ):
        if num <= 0:
            raise ValueError("num must be positive")
        self.base = base
        self.num = num
        self.id_prefix = id_prefix
        self.use_gpu = use_gpu
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.replicas: list[LaunchedReplica] = []

    def start(self) -> list[LaunchedReplica]:
        """Create all actors, then wait for each; returns them with their addresses."""
        use_gpu = cluster_has_gpus() if self.use_gpu is None else self.use_gpu
        actor_cls = ray.remote(ReplicaActor)
        handles = []
        for i in range(self.num):
            rid = f"{self.id_prefix}-{i}"
            settings = dataclasses.replace(self.base, replica_id=rid)
            handles.append((rid, actor_cls.options(**actor_options(rid, use_gpu, num_gpus=settings.tensor_parallel_size)).remote(settings)))
        try:
            for rid, handle in handles:
                info = ray.get(handle.info.remote(), timeout=self.start_timeout_s)
                if not settings.tls_cert:
                    # NOTE: with mutual TLS the port answers only the router's certificate;
                    # the actor's info() returned after its server was up and SERVING.
                    wait_healthy(info["address"], timeout_s=self.start_timeout_s)
                self.replicas.append(LaunchedReplica(rid, info["address"], info["device"], handle, info.get("metrics_url", "")))
                log.info("replica %s healthy at %s (%s)", rid, info["address"], info["device"])
        except BaseException:
            self.replicas = [LaunchedReplica(rid, "", "", h) for rid, h in handles]
            self.stop()
            raise
        return list(self.replicas)

    def stop(self) -> None:
        """Ask each actor to shut down (deletes its heartbeat), then kill it without restart."""
        refs = [(r, r.handle.shutdown.remote()) for r in self.replicas]
        for r, ref in refs:
            try:
                ray.get(ref, timeout=self.stop_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the actor is killed below either way
                log.warning("replica %s did not shut down cleanly: %s", r.replica_id, exc)
        for r in self.replicas:
            ray.kill(r.handle, no_restart=True)
        self.replicas = []
