"""A TCP relay that forwards every byte both ways and keeps a copy: the man in the middle
of the security tests and ``bench.attacks`` (what could it read between router and replica?)."""

from __future__ import annotations

import asyncio


class RecordingRelay:
    """Listens on 127.0.0.1:<free port> (``address``); each connection is forwarded to
    ``127.0.0.1:upstream_port``, and every byte either way is appended to ``seen``."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.seen = bytearray()
        self._server: asyncio.Server | None = None

    async def start(self) -> "RecordingRelay":
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        assert self._server is not None, "start() first"
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.seen.extend(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(client_reader, up_writer), self._pipe(up_reader, client_writer))
