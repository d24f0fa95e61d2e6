"""The request class: who sent a request and what kind of work it is.

One definition used by the classifier, the router, the replica's KV store (eviction
policies receive it on release) and the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Task(str, Enum):
    """Task labels of the trace format (docs/trace-format.md)."""

    CHAT = "chat"
    AGENT = "agent"
    CODE = "code"
    MATH = "math"
    QA = "qa"
    TOOL = "tool"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str | None) -> "Task":
        if value is None or value == "":
            return cls.OTHER
        try:
            return cls(value)
        except ValueError as exc:
            valid = ", ".join(t.value for t in cls)
            raise ValueError(f"unknown task {value!r} (valid: {valid})") from exc


DEFAULT_TENANT = "default"


@dataclass(slots=True, frozen=True)
class RequestClass:
    """Classification of one request.

    Attributes:
        tenant: tenant name (maps to the cache salt).
        session_id: set for requests known to belong to a multi-turn session.
        turn: 0-based turn index inside the session (0 for single-turn requests).
        task: task label, given or inferred.
        template: True when the prompt starts with a prefix shared by many requests
            outside one session (a structural template).
        template_blocks: how many leading prompt blocks form the template (0 if unknown
            or not templated).
        inferred: True when the fields came from the classifier rather than labels.
    """

    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    turn: int = 0
    task: Task = Task.OTHER
    template: bool = False
    template_blocks: int = 0
    inferred: bool = False

    @property
    def multi_turn(self) -> bool:
        """Part of a session (so its blocks are likely reused by a later turn)."""
        return self.session_id is not None

    @property
    def agentic(self) -> bool:
        return self.task in (Task.AGENT, Task.TOOL) and self.multi_turn


SINGLE_TURN = RequestClass()
