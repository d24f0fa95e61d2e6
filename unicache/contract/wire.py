"""Shared domain types <-> their protobuf messages (one definition for router and replica)."""

from __future__ import annotations

from unicache.contract.request_class import RequestClass, Task
from unicache.v1 import common_pb2

# Trailing-metadata key of a replica's RESOURCE_EXHAUSTED: "overloaded" (its queue is
# full: retry later, HTTP 429) or "too_large" (the request can never fit: HTTP 413).
REFUSAL_METADATA = "unicache-refusal"


def request_class_to_proto(cls: RequestClass) -> common_pb2.RequestClass:
    return common_pb2.RequestClass(
        tenant=cls.tenant,
        session_id=cls.session_id or "",
        turn=cls.turn,
        task=cls.task.value,
        template=cls.template,
        template_blocks=cls.template_blocks,
        inferred=cls.inferred,
    )


def request_class_from_proto(msg: common_pb2.RequestClass) -> RequestClass:
    """An unset message gives the default single-turn class. An unknown task raises ValueError."""
    kwargs = {"tenant": msg.tenant} if msg.tenant else {}
    return RequestClass(
        session_id=msg.session_id or None,
        turn=msg.turn,
        task=Task.parse(msg.task or None),
        template=msg.template,
        template_blocks=msg.template_blocks,
        inferred=msg.inferred,
        **kwargs,
    )
