"""Settings dataclasses -> command-line flags, environment variables and config-file keys.

A field ``foo_bar`` of a settings dataclass is the flag ``--foo-bar``, the environment
variable ``UNICACHE_FOO_BAR`` and the config-file key ``foo_bar`` (or ``foo-bar``).
Precedence, lowest first: the field's default, the config file, the environment, the
flag, explicit overrides. Field help comes from ``field(metadata={"help": ...})``.
Secret fields are never echoed in help defaults or error messages. A secret given as a
flag still works, but ``build`` prints a warning to stderr: any local user can read a
process's command line (``/proc/<pid>/cmdline``); the environment or a file (a
``<name>_file`` setting, read by ``resolve_secret``) is private to the user.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from unicache.plumbing.errors import UsageError

ENV_PREFIX = "UNICACHE_"
CONFIG_ENV = "UNICACHE_CONFIG"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def convert(name: str, kind: type, value: Any, source: str, secret: bool = False) -> Any:
    """Convert a raw value to the field's type; a bad value is a one-line UsageError."""
    if kind is str and isinstance(value, (dict, list)):
        return json.dumps(value)  # a structured config-file value of a text setting
    try:
        return parse_bool(value) if kind is bool else kind(value)
    except (TypeError, ValueError):
        shown = "***" if secret else repr(value)
        raise UsageError(f"{source}: {name} must be {kind.__name__}, got {shown}") from None


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON mapping; keys may use dashes or underscores."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is a user error
        raise UsageError(f"config file {path}: cannot parse: {_parse_error(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path}: expected a mapping at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _parse_error(exc: Exception) -> str:
    """Where and what, without the offending text: YAML's own message quotes the line,
    which may hold a secret (``salt_secret: "abc...``)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{getattr(exc, 'problem', None) or 'syntax error'} at line {mark.line + 1} column {mark.column + 1}"
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    return type(exc).__name__


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    secrets: frozenset[str] = frozenset(),
    skip: tuple[str, ...] = (),
    aliases: dict[str, list[str]] | None = None,
    config_flag: bool = True,
) -> None:
    """Add ``--config`` (optional) and one flag per field; unset flags stay ``None``."""
    if config_flag:
        parser.add_argument("--config", default=None, help=f"YAML/JSON config file (env {CONFIG_ENV})")
    types = field_types(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        kind = types[f.name]
        default = f.default if f.default is not MISSING else None
        shown = "" if f.name in secrets else f", default {default!r}"
        flags = ["--" + f.name.replace("_", "-"), *((aliases or {}).get(f.name, []))]
        parser.add_argument(
            *flags,
            dest=f"cfg_{f.name}",
            metavar=f.name.upper(),
            default=None,
            type=str if kind is bool else kind,
            help=f"{f.metadata.get('help', '')} (env {env_name(f.name)}{shown})",
        )


def build(
    cls: type,
    args: argparse.Namespace | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    secrets: frozenset[str] = frozenset(),
):
    """Merge defaults < config file < environment < flags < ``overrides`` into ``cls``."""
    env = dict(os.environ) if env is None else env
    types = field_types(cls)
    values: dict[str, Any] = {}
    path = getattr(args, "config", None) if args is not None else None
    path = path or env.get(CONFIG_ENV)
    if path:
        for key, value in load_config_file(path).items():
            if key not in types:
                raise UsageError(f"config file {path}: unknown setting {key!r}")
            values[key] = convert(key, types[key], value, f"config file {path}", key in secrets)
    for name, kind in types.items():
        if env_name(name) in env:
            values[name] = convert(name, kind, env[env_name(name)], env_name(name), name in secrets)
    if args is not None:
        for name, kind in types.items():
            value = getattr(args, f"cfg_{name}", None)
            if value is not None:
                flag = "--" + name.replace("_", "-")
                values[name] = convert(name, kind, value, flag, name in secrets)
                if name in secrets and value:
                    warn_secret_flag(flag, name)
    for name, value in (overrides or {}).items():
        if name not in types:
            raise UsageError(f"unknown setting {name!r}")
        values[name] = value
    return cls(**values)


def warn_secret_flag(flag: str, name: str) -> None:
    """One stderr line: a secret on the command line is readable by every local user."""
    alt = f"{env_name(name)} or {env_name(name)}_FILE" if name + "_file" in SECRET_FILE_FIELDS else env_name(name)
    print(
        f"warning: {flag} on the command line is visible to every local user in /proc/<pid>/cmdline; "
        f"set {alt} instead",
        file=sys.stderr,
        flush=True,
    )


# Settings fields that name a file holding a secret (``<secret>_file``); see resolve_secret.
SECRET_FILE_FIELDS = frozenset({"cluster_key_file", "redis_password_file", "salt_secret_file", "admin_key_file"})


def resolve_secret(value: str, path: str, name: str) -> str:
    """A secret from its value or, when the value is empty, from the file ``path``
    (surrounding whitespace stripped). A file that cannot be read is a UsageError naming
    the setting and the path, never the content."""
    if value or not path:
        return value
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"cannot read {name}_file {path}: {exc.strerror}") from None
