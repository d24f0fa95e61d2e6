"""Render OpenAI-style chat messages into one prompt string.

The template (documented in the README; the replicas see only the rendered text's token
ids) is, per message::

    <|{role}|>\n{content}\n

followed by ``<|assistant|>\n`` so the model continues as the assistant. Because every
turn appends to the previous rendering, turn k+1's prompt starts with turn k's whole
prompt and output, which is exactly what prefix caching and session routing exploit.
"""

from __future__ import annotations

from typing import Any

from unicache.router.json_input import JsonInputError, loads_bounded

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatFormatError(ValueError):
    """The messages are not a list of {role, content} objects (HTTP 400)."""


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"messages[{i}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts")


def render_chat(messages: Any) -> str:
    """The prompt for ``messages`` (see the module docstring); raises ChatFormatError."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatFormatError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        out.append(f"<|{role}|>\n{_content_text(msg.get('content'), i)}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def render_chat_json(text: str) -> str:
    """``render_chat`` of a JSON-encoded messages array (the gRPC ``chat_json`` field)."""
    try:
        messages = loads_bounded(text, "chat_json")
    except JsonInputError as exc:
        raise ChatFormatError(str(exc)) from None
    return render_chat(messages)
