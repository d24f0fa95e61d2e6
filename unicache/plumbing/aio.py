"""Small asyncio helpers shared by the replica and the router."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float = 5.0) -> set[asyncio.Task]:
    """Cancel ``tasks`` and wait until they finish; returns those still running after ``timeout_s``.

    NOTE: on Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that arrives as
    its inner awaitable completes (gh-86296), so a loop built on it may survive one
    ``cancel()``; a bare ``await task`` then hangs forever. Cancelling again on every
    round until the task is done makes shutdown bounded.
    """
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(0.1, remaining))
    return pending


async def with_deadline(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` within ``timeout_s`` (TimeoutError after), in the calling task.

    NOTE: not ``asyncio.wait_for``, which on Python 3.11 runs ``aw`` as a task of its own:
    cancelled at shutdown while its connection is being closed (Ctrl-C reaches Redis too),
    that task ends with the connection error instead, nobody retrieves it, and asyncio
    prints "Task exception was never retrieved" with a Redis traceback on the way out.
    """
    async with asyncio.timeout(timeout_s):
        return await aw
