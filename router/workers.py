"""Run the router as one process, or as N worker processes sharing its ports.

``unicache router --workers N`` starts N processes (multiprocessing ``spawn``), each a
whole ``RouterApp`` on its own event loop with ``reuse_port`` set: the kernel spreads new
connections over the processes that listen on the gRPC and HTTP ports (SO_REUSEPORT), so
one connection (a gRPC channel, an HTTP keep-alive connection) stays with one process.
Each worker follows Redis itself (its own subscriber and locality index: one view of the
cluster, built from the same signed state), follows every vLLM backend itself (its own
events subscription, a PUB socket serves any number, and its own ``/metrics`` scrapes)
and shares session placement through Redis
(``unicache.router.cluster.session_store``), so a session's turns reach the same replica through
any worker or pod.

Invariants:
    * The supervisor holds no router state and serves nothing; it forwards SIGINT/SIGTERM
      to every worker and waits ``stop_grace_s`` for them, then kills what is left.
    * A worker that exits on its own (a crash, a failed bind) stops the others and the
      supervisor exits non-zero: a pod whose router lost a worker restarts whole rather
      than serve on with fewer processes than configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import signal
import time

from unicache.router.config import RouterConfig

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def serve(cfg: RouterConfig) -> None:
    """One router process: run ``RouterApp(cfg)`` until SIGINT/SIGTERM, then stop it."""
    from unicache.router.app import RouterApp
    from unicache.router.frontends.http_server import loop_factory

    async def main() -> None:
        # NOTE: the app is built on the running loop. Built before it (as this command
        # once did), grpc.aio bound itself to a loop of its own choosing: under uvloop the
        # grpc server was then never stopped and SIGTERM hung the process.
        app = RouterApp(cfg)
        task = asyncio.create_task(app.serve_forever())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
        runner.run(main())


def _worker(cfg: RouterConfig, index: int, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s [worker {index}] %(name)s: %(message)s")
    serve(cfg)


def worker_config(cfg: RouterConfig) -> RouterConfig:
    """A worker's settings: the supervisor's, as one process that shares its ports."""
    return dataclasses.replace(cfg, workers=1, reuse_port=True)


def run_workers(cfg: RouterConfig, log_level: str = "info", stop_grace_s: float = 10.0) -> int:
    """Start ``cfg.workers`` worker processes and supervise them (see the module
    docstring). Returns the exit status: 0 after a signal-initiated stop, 1 when a worker
    exited on its own."""
    ctx = mp.get_context("spawn")
    wcfg = worker_config(cfg)
    procs = [ctx.Process(target=_worker, args=(wcfg, i, log_level), name=f"unicache-router-{i}") for i in range(cfg.workers)]
    stopping = False

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.start()
        log.info("router supervisor: %d workers (pids %s)", len(procs), [p.pid for p in procs])
        while not stopping and all(p.is_alive() for p in procs):
            time.sleep(0.1)
        crashed = not stopping
        if crashed:
            dead = [(p.name, p.exitcode) for p in procs if not p.is_alive()]
            log.error("router worker exited on its own (%s); stopping the others", dead)
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: the worker stops its servers gracefully
        deadline = time.monotonic() + stop_grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                log.warning("router worker %s did not stop within %g s; killing it", p.name, stop_grace_s)
                p.kill()
                p.join()
        return 1 if crashed else 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
