"""The ``unicache`` command. Each subcommand lives in its own module and registers itself.

A subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func`` (a callable taking the parsed args and returning an exit code). Add a module to
``SUBCOMMAND_MODULES`` to add a subcommand.

Errors a user can fix (bad input, unreachable service) are raised as ``UsageError`` and
end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from unicache.errors import UsageError

SUBCOMMAND_MODULES: list[str] = [
    "unicache.sim.cli",  # unicache sim, unicache gen-workload
    "router.cli",  # unicache router, unicache status
    "replica.cli",  # unicache replica, unicache replicas
    # "unicache.local_cluster",  -> unicache up, unicache demo
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unicache", description="UniCache Serving: cache-aware LLM routing")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"unicache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
