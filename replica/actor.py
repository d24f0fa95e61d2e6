"""The replica as a Ray actor.

``ReplicaActor`` has an async ``__init__`` (Ray runs it on the actor's event loop), so a
restarted actor -- Ray re-runs ``__init__`` with the same arguments -- comes back serving
on its own, with the same replica id, a fresh gRPC port and a new publisher epoch.
``actor_options`` gives the scheduling options: restarts forever, the replica's GPUs (its
``tensor_parallel_size``) when the cluster has GPUs, else one CPU.
"""

from __future__ import annotations

from typing import Any

from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings

ACTOR_NAMESPACE = "unicache"


def actor_name(replica_id: str) -> str:
    return f"unicache-replica-{replica_id}"


def actor_options(replica_id: str, use_gpu: bool, max_task_retries: int = 3, num_gpus: int = 1) -> dict[str, Any]:
    """Ray options for one replica actor.

    Args:
        use_gpu: request ``num_gpus`` GPUs (else one CPU); the launcher decides from the
            cluster's resources, not from the driver's own devices.
        max_task_retries: retries of a method call interrupted by an actor restart.
        num_gpus: GPUs of one replica: its engine's ``tensor_parallel_size`` (vLLM's workers
            then see exactly those GPUs).
    """
    opts: dict[str, Any] = {
        "name": actor_name(replica_id),
        "namespace": ACTOR_NAMESPACE,
        "max_restarts": -1,
        "max_task_retries": max_task_retries,
        "max_concurrency": 64,
    }
    if use_gpu:
        opts.update(num_gpus=num_gpus, num_cpus=1)
    else:
        opts.update(num_gpus=0, num_cpus=1)
    return opts


class ReplicaActor:
    """Wraps one ``ReplicaRuntime``; methods are called by the launcher only (clients use gRPC)."""

    async def __init__(self, settings: ReplicaSettings):
        if settings.host in ("0.0.0.0", "::") and not settings.advertise_host:
            import dataclasses

            import ray

            # NOTE: on a multi-node cluster the address routers dial is this node's IP as
            # Ray knows it (the pod IP under KubeRay), not the driver's.
            settings = dataclasses.replace(settings, advertise_host=ray.util.get_node_ip_address())
        self.runtime = ReplicaRuntime(settings)
        await self.runtime.start()

    async def info(self) -> dict:
        """replica_id, address (host:port of the gRPC server), device, epoch, pid."""
        import os

        return {**self.runtime.info(), "pid": os.getpid()}

    async def set_faults(self, first_token_delay_s: float = 0.0, token_delay_s: float = 0.0) -> None:
        """Change the fault-injection delays (replica/serving/faults.py) of the running server; a
        restarted actor starts again from its settings."""
        from unicache.replica.serving.faults import FaultInjection

        self.runtime.server.servicer.faults = FaultInjection(first_token_delay_s, token_delay_s)

    async def cached_hashes(self) -> list[bytes]:
        """Every block hash the replica's prefix cache holds now (what its summary would list)."""
        return list(self.runtime.engine.cached_hashes())

    async def shutdown(self) -> None:
        await self.runtime.stop()
