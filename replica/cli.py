"""``unicache replica`` (one replica process, no Ray: debugging and k8s pods) and
``unicache replicas`` (launch N Ray actors and hold them until Ctrl-C/SIGTERM).

Every setting is a flag and an environment variable ``UNICACHE_<NAME>`` (replica/settings.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading

from unicache.plumbing.errors import UsageError
from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait
from unicache.replica.settings import add_settings_arguments, env_name, settings_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    one = subparsers.add_parser("replica", help="run one replica (engine + gRPC + Redis publisher) without Ray")
    add_settings_arguments(one)
    one.set_defaults(func=run_replica)

    many = subparsers.add_parser("replicas", help="launch N replica Ray actors; stop them on Ctrl-C/SIGTERM")
    many.add_argument("--num", type=int, default=None, help=f"number of replicas [env {env_name('num')}; default 1]")
    many.add_argument(
        "--ray-address", default=None, help=f"Ray cluster to join [env {env_name('ray_address')}; default: in-process]"
    )
    many.add_argument("--id-prefix", default=None, help=f"replica ids are PREFIX-i [env {env_name('id_prefix')}; default replica]")
    many.add_argument(
        "--gpu", default=None, choices=["auto", "yes", "no"], help=f"one GPU per replica [env {env_name('gpu')}; default auto]"
    )
    add_settings_arguments(many, skip=("replica_id", "port"))
    many.set_defaults(func=run_replicas)


def _flag_or_env(args: argparse.Namespace, name: str, default: str) -> str:
    value = getattr(args, name)
    return value if value is not None else os.environ.get(env_name(name), default)


def _wait_for_signal() -> None:
    """Block the main thread until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def run_replica(args: argparse.Namespace) -> int:
    prefer_passive_omp_wait()
    from unicache.replica.runtime import ReplicaRuntime

    settings = settings_from_args(args)
    settings.check()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        runtime = ReplicaRuntime(settings)
        try:
            address = await runtime.start()
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        print(f"replica {settings.replica_id} serving on {address} ({runtime.engine.device})", flush=True)
        if runtime.metrics_url:
            print(f"replica {settings.replica_id} metrics on {runtime.metrics_url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runtime.stop()

    asyncio.run(main())
    return 0


def run_replicas(args: argparse.Namespace) -> int:
    prefer_passive_omp_wait()  # inherited by in-process Ray's workers
    import ray

    from unicache.replica.launcher import ReplicaLauncher

    try:
        num = int(_flag_or_env(args, "num", "1"))
    except ValueError:
        raise UsageError(f"--num / {env_name('num')} must be an integer") from None
    if num <= 0:
        raise UsageError("--num must be positive")
    gpu = _flag_or_env(args, "gpu", "auto")
    if gpu not in ("auto", "yes", "no"):
        raise UsageError(f"{env_name('gpu')} must be auto, yes or no, got {gpu!r}")
    base = settings_from_args(args)
    base.check(local_paths=False)  # NOTE: checkpoint paths are the Ray workers', not this launcher's
    if not base.redis_url:
        raise UsageError("--redis-url (or UNICACHE_REDIS_URL) is required: routers find replicas through Redis")
    ray_address = _flag_or_env(args, "ray_address", "") or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
    launcher = ReplicaLauncher(
        base, num, id_prefix=_flag_or_env(args, "id_prefix", "replica"), use_gpu={"auto": None, "yes": True, "no": False}[gpu]
    )
    try:
        for r in launcher.start():
            print(f"replica {r.replica_id} serving on {r.address} ({r.device})", flush=True)
            if r.metrics_url:
                print(f"replica {r.replica_id} metrics on {r.metrics_url}", flush=True)
        _wait_for_signal()
    finally:
        launcher.stop()
        ray.shutdown()
    return 0
