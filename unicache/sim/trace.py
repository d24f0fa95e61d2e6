"""The one trace reader (JSON Lines, docs/trace-format.md) used by the simulator and benchmarks.

Every error names the file, the 1-based line number and the offending field, so the CLI
can print one line and exit 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from unicache.contract.request_class import Task


class TraceError(ValueError):
    """A malformed trace line. ``str(err)`` is a complete one-line message."""

    def __init__(self, path: str, line: int, field_name: str | None, reason: str):
        self.path, self.line, self.field, self.reason = path, line, field_name, reason
        what = f" field '{field_name}'" if field_name else ""
        super().__init__(f"{path}:{line}:{what} {reason}")


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace. Optional label fields are ``None`` when absent."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    output_hash_ids: list[int] = field(default_factory=list)
    session_id: str | None = None
    turn: int | None = None
    task: Task | None = None
    tenant: str | None = None
    template: bool | None = None

    @property
    def labelled(self) -> bool:
        return self.session_id is not None or self.task is not None or self.template is not None


def _int_field(obj: dict, name: str, path: str, line: int, *, required: bool, minimum: int = 0) -> int | None:
    if name not in obj:
        if required:
            raise TraceError(path, line, name, "is missing")
        return None
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TraceError(path, line, name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum}, got {value!r}")
    return int(value)


def _id_list(obj: dict, name: str, path: str, line: int, *, required: bool) -> list[int]:
    if name not in obj:
        if required:
            raise TraceError(path, line, name, "is missing")
        return []
    value = obj[name]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TraceError(path, line, name, "must be a list of integers")
    return value


def parse_trace_line(text: str, path: str, line: int, index: int) -> TraceRequest:
    """Parse one JSON line into a ``TraceRequest``; raises ``TraceError``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(path, line, None, f"invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, None, "a line must be a JSON object")
    ts = obj.get("timestamp")
    if "timestamp" not in obj:
        raise TraceError(path, line, "timestamp", "is missing")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(path, line, "timestamp", f"must be a non-negative number, got {ts!r}")
    input_length = _int_field(obj, "input_length", path, line, required=True, minimum=1)
    output_length = _int_field(obj, "output_length", path, line, required=True, minimum=0)
    hash_ids = _id_list(obj, "hash_ids", path, line, required=True)
    if not hash_ids:
        raise TraceError(path, line, "hash_ids", "must not be empty")
    output_hash_ids = _id_list(obj, "output_hash_ids", path, line, required=False)
    turn = _int_field(obj, "turn", path, line, required=False, minimum=0)
    task = None
    if "task" in obj:
        try:
            task = Task.parse(obj["task"])
        except (ValueError, TypeError) as exc:
            raise TraceError(path, line, "task", str(exc)) from None
    template = obj.get("template")
    if template is not None and not isinstance(template, bool):
        raise TraceError(path, line, "template", f"must be true or false, got {template!r}")
    session = obj.get("session_id")
    if session is not None and not isinstance(session, (str, int)):
        raise TraceError(path, line, "session_id", "must be a string or integer")
    tenant = obj.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise TraceError(path, line, "tenant", "must be a string")
    return TraceRequest(
        index=index,
        timestamp_ms=float(ts),
        input_length=input_length,
        output_length=output_length,
        hash_ids=hash_ids,
        output_hash_ids=output_hash_ids,
        session_id=None if session is None else str(session),
        turn=turn,
        task=task,
        tenant=tenant,
        template=template,
    )


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Yield the requests of a trace file in file order (blank lines are skipped)."""
    p = str(path)
    try:
        fh = open(p, encoding="utf-8")
    except OSError as exc:
        raise TraceError(p, 0, None, f"cannot open ({exc.strerror})") from None
    with fh:
        index = 0
        for lineno, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            yield parse_trace_line(text, p, lineno, index)
            index += 1


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a whole trace, sorted by timestamp (stable, so file order breaks ties)."""
    requests = list(iter_trace(path))
    if not requests:
        raise TraceError(str(path), 0, None, "trace is empty")
    requests.sort(key=lambda r: r.timestamp_ms)
    for i, r in enumerate(requests):
        r.index = i
    return requests


def write_trace(path: str | Path, requests: list[dict]) -> None:
    """Write request dicts as JSON Lines (used by the workload generator and tests)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
