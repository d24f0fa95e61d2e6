"""``--backend URL,kv-events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,id=NAME][,kv-topic=TOPIC]``:
one stock vLLM OpenAI server the router forwards to (pure parsing, no I/O).

A backend's id is ``id=`` when given, else ``vllm-<host>-<port>`` of its URL; its events
address is where its ``--kv-events-config`` endpoint publishes (vLLM binds a wildcard
endpoint such as ``tcp://*:5557``; the router connects to the pod's address). Without
``kv-events`` the router still forwards to it but cannot route by prefix to it, unless the
router listens (``--kv-events-listen``): then the server publishes to the router, and its
stream is the one on topic ``kv-topic=`` (default: its id, or llm-d's ``kv@<its host>@<model>``;
router/upstream/vllm_fleet/events_listener.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from unicache.plumbing.errors import UsageError

_KEYS = ("kv-events", "replay", "id", "kv-topic")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    backend_id: str
    url: str  # base URL, no trailing slash: http://host:port
    events: str = ""  # tcp://host:port of its KV events PUB ("": none)
    replay: str = ""  # tcp://host:port of its replay ROUTER ("": none)
    topic: str = ""  # its events' topic on the router's listener ("": its id or llm-d's kv@<host>@...)


def parse_backend(text: str) -> BackendSpec:
    """One ``--backend`` value; a UsageError names what is wrong with it."""
    url, *options = [p.strip() for p in text.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise UsageError(f"--backend {text!r}: expected an http(s)://host:port base URL first (no path), then kv-events=tcp://HOST:PORT")
    values: dict[str, str] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep or key not in _KEYS or not value:
            raise UsageError(f"--backend {text!r}: unknown option {opt!r} (known: {', '.join(k + '=' for k in _KEYS)})")
        if key in ("kv-events", "replay") and not value.startswith("tcp://"):
            raise UsageError(f"--backend {text!r}: {key} must be a tcp://HOST:PORT address")
        values[key] = value
    port = parts.port or (443 if parts.scheme == "https" else 80)
    backend_id = values.get("id") or f"vllm-{parts.hostname}-{port}"
    if "kv-topic" in values and "kv-events" in values:
        raise UsageError(f"--backend {text!r}: kv-events= (the router connects to the server) and kv-topic= (the server "
                         "publishes to the router's --kv-events-listen) exclude each other")
    return BackendSpec(backend_id, f"{parts.scheme}://{parts.netloc}", values.get("kv-events", ""), values.get("replay", ""),
                       values.get("kv-topic", ""))


def backend_entries(value: str) -> list[str]:
    """The entries of the ``backends`` setting: a JSON list of ``--backend`` values (a
    config file's list), or values separated by ``;`` or newlines (the environment)."""
    value = value.strip()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError as exc:
            raise UsageError(f"backends: not a JSON list of strings ({exc})") from None
    else:
        items = value.replace("\n", ";").split(";")
    return [str(item).strip() for item in items if str(item).strip()]


def parse_backends(value: str) -> list[BackendSpec]:
    """``backend_entries(value)`` parsed; ids must be unique."""
    specs = [parse_backend(item) for item in backend_entries(value)]
    seen: set[str] = set()
    for spec in specs:
        if spec.backend_id in seen:
            raise UsageError(f"two backends have the id {spec.backend_id!r}: give one an id=NAME")
        seen.add(spec.backend_id)
    return specs
