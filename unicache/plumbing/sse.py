"""Reading an OpenAI-style server-sent-event stream: the one reader for ``unicache bench``
and the live A/B client (the router relays vLLM's events without reading them as JSON:
router/upstream/vllm_fleet/relay.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


async def sse_events(resp) -> AsyncIterator[dict]:
    """The JSON events of ``resp``'s ``data:`` lines (an ``httpx`` streaming response), up
    to ``data: [DONE]``; other lines are skipped; ``json.JSONDecodeError`` (a ValueError)
    for a ``data:`` line that is not JSON.

    After ``[DONE]`` the body is read to its end (nothing follows it) instead of being
    left unread: a response closed before its last chunk closes its connection too, so
    every request would pay a new TCP connection."""
    lines = resp.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            async for _ in lines:
                pass
            return
        yield json.loads(data)
