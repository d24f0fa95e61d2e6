"""One way for tests to wait for something asynchronous: poll with a deadline.

The deadline only bounds a hang; it is never a timing assertion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(
    cond: Callable[[], Any | Awaitable[Any]], what: str = "condition", timeout_s: float = 20.0, every_s: float = 0.02
) -> Any:
    """Poll ``cond`` (sync, or returning an awaitable) until its value is truthy; return it.

    Raises AssertionError naming ``what`` once ``timeout_s`` has passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(every_s)
