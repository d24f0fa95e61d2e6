"""The gRPC ``chat_json`` field to a prompt: bounded JSON parsing, then the shared renderer.

Rendering itself (the tokenizer's own chat template) is ``unicache.contract.chat_template``, one
definition for the router and the replicas; this module adds only the router's input
checks on the JSON text.
"""

from __future__ import annotations

from unicache.contract.chat_template import ChatFormatError, ChatTemplate, render_chat
from unicache.router.frontends.json_input import JsonInputError, loads_bounded


def render_chat_json(text: str, template: ChatTemplate | None) -> str:
    """``render_chat`` of a JSON-encoded messages array; ChatFormatError for bad or too deep JSON."""
    try:
        messages = loads_bounded(text, "chat_json")
    except JsonInputError as exc:
        raise ChatFormatError(str(exc)) from None
    return render_chat(messages, template)
