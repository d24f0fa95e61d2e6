"""``unicache router`` (run the router) and ``unicache status [--router ADDR]``."""

from __future__ import annotations

import argparse
import logging

from unicache.contract.endpoints import LOCAL_ROUTER, ROUTER_ENV, default_router
from unicache.plumbing.errors import UsageError
from unicache.router.config import add_config_arguments, build_config


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router",
        help="run the cache-aware router (gRPC + OpenAI-compatible HTTP)",
        description="Run the router. Every setting is a flag, an env var UNICACHE_<NAME>, or a key in --config.",
    )
    add_config_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_router)

    s = subparsers.add_parser("status", help="show the cluster's cache state as the router sees it")
    s.add_argument("--router", default=default_router(), metavar="HOST:PORT",
                   help=f"the router's gRPC address (env {ROUTER_ENV}; default: the local router, {LOCAL_ROUTER})")
    s.add_argument("--timeout", type=float, default=5.0, help="deadline in seconds (default 5)")
    s.set_defaults(func=run_status)


def run_router(args: argparse.Namespace) -> int:
    from unicache.router.workers import LOG_FORMAT, run_workers, serve

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    cfg = build_config(args)
    logging.getLogger("router").info("config: %s", cfg.describe())
    if cfg.workers > 1:
        return run_workers(cfg, args.log_level)
    serve(cfg)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from unicache.router.observability.status import admin_key_from_env, fetch_cluster_state, format_table

    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    print(format_table(fetch_cluster_state(args.router, args.timeout, admin_key_from_env())))
    return 0
