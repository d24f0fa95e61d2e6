"""An ASGI app served by uvicorn on a free loopback port inside the test's own event loop.

Invariants:
    * Binds 127.0.0.1 on port 0; ``url`` is set once ``start`` returns and names the bound port.
    * ``stop`` ends the server and waits for its task; a server that failed to start raises
      its error from ``start`` instead of hanging.
"""

from __future__ import annotations

import asyncio

import uvicorn


class LoopbackAsgi:
    """uvicorn on 127.0.0.1:0 running ``app`` as a task of the current loop."""

    def __init__(self, app) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self._task: asyncio.Task | None = None
        self.url = ""

    async def start(self) -> str:
        """Serve, wait until bound, and return the base URL."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the reason it did not start
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
