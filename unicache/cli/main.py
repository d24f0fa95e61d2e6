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

from unicache.plumbing.errors import UsageError

SUBCOMMAND_MODULES: list[str] = [
    "unicache.sim.cli",  # unicache sim, unicache gen-workload
    "unicache.router.cli",  # unicache router, unicache status
    "unicache.replica.cli",  # unicache replica, unicache replicas
    "unicache.cli.local_cluster",  # unicache up
    "unicache.cli.demo",  # unicache demo
    "unicache.bench_client.client",  # unicache bench
]


_FIRST_PARTY = frozenset({"unicache", "router", "replica"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unicache", description="UniCache Serving: cache-aware LLM routing")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    unavailable = []
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # NOTE: images install subsets of the dependencies (the router image has no
            # torch or ray), so a subcommand whose module needs a missing third-party
            # package is left out rather than breaking every other subcommand. A missing
            # first-party module is a bug and still raises.
            missing = (exc.name or "").split(".")[0]
            if not missing or missing in _FIRST_PARTY:
                raise
            unavailable.append(f"{name} (needs {missing})")
            continue
        module.register(sub)
    if unavailable:
        parser.epilog = "not available in this installation: " + ", ".join(unavailable)
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
