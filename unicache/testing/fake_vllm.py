"""A fake vLLM OpenAI server for tests and benchmarks: answers what the router asks a
backend (``/health``, ``/v1/models``, ``/metrics``) and streams completions and chat
completions as vLLM does (``data:`` events, the final usage chunk when
``stream_options.include_usage`` is set, ``data: [DONE]``), with faults on demand.

It serves the models of ``models`` (vLLM's ``/v1/models`` entries, ``model_card``; a
test may change the list at run time, as vLLM's ``/v1/load_lora_adapter`` does) and
answers in the name the request gives.

``mode`` (per server, changeable between requests): ``ok``; ``refuse`` (503, as a vLLM
shutting down); ``invalid`` (400 with vLLM's error body); ``stall`` (the request is read,
nothing is answered); ``die`` (the first event, then the connection closes). Every request
body is kept in ``bodies`` (parsed JSON).
"""

from __future__ import annotations

import asyncio
import json

VLLM_ERROR = {"error": {"message": "min_tokens must be greater than or equal to 0, got -1.", "type": "BadRequestError",
                        "param": None, "code": 400}}


def model_card(name: str, parent: str | None = None, max_model_len: int = 2048) -> dict:
    """One entry of vLLM's ``/v1/models`` list (``parent``: a LoRA adapter's base model)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": parent or name, "parent": parent,
            "max_model_len": max_model_len}


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeVllm:
    """See the module docstring.

    Args:
        models: its ``/v1/models`` entries (default: one model, "fake-model").
        block_size: the block size its ``/metrics`` reports (the router's must match).
        tokens: tokens per answer unless the request asks ``max_tokens``.
        cached_tokens: what its usage reports as ``prompt_tokens_details.cached_tokens``.
    """

    def __init__(self, models: list[dict] | None = None, block_size: int = 16, tokens: int = 4, cached_tokens: int = 0):
        self.models = models if models is not None else [model_card("fake-model")]
        self.block_size = block_size
        self.tokens = tokens
        self.cached_tokens = cached_tokens
        self.mode = "ok"
        self.token_delay_s = 0.0  # between streamed tokens
        self.gpu_blocks = 1000  # the pool its /metrics reports
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.disconnected = 0  # requests whose client left before the answer ended
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> FakeVllm:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
                if len(request_line) != 3:  # not HTTP (a peer router's bare probe): answered as vLLM's server would
                    self._send(writer, 400, "text/plain", b"Invalid HTTP request received.")
                    await writer.drain()
                    break
                method, path, _ = request_line
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if not await self._answer(method, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _send(self, writer, status: int, content_type: str, body: bytes) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}.get(status, "X")
        writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (status, reason.encode(), content_type.encode(), len(body), body))

    async def _answer(self, method: str, path: str, raw: bytes, writer) -> bool:
        if method == "GET":
            if path == "/health":
                self._send(writer, 200, "application/json", b"")
            elif path == "/v1/models":
                self._send(writer, 200, "application/json", json.dumps({"object": "list", "data": self.models}).encode())
            elif path == "/metrics":
                page = (f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="{self.gpu_blocks}"}} 1.0\n'
                        f'vllm:num_requests_running{{engine="0"}} 0.0\nvllm:num_requests_waiting{{engine="0"}} 0.0\n')
                self._send(writer, 200, "text/plain; version=0.0.4", page.encode())
            else:
                self._send(writer, *self._other(path))
            await writer.drain()
            return True
        try:
            body = json.loads(raw)
        except ValueError:  # e.g. a router's bodiless POST probe
            self._send(writer, 400, "application/json", b'{"error":{"message":"the body is not JSON"}}')
            await writer.drain()
            return True
        self.bodies.append(body)
        self.paths.append(path)
        mode = self.mode
        if mode == "refuse":
            self._send(writer, 503, "application/json", b'{"error":{"message":"shutting down"}}')
        elif mode == "invalid":
            self._send(writer, 400, "application/json", json.dumps(VLLM_ERROR).encode())
        elif mode == "stall":
            await asyncio.Event().wait()
        else:
            return await self._generate(path, body, writer, mode)
        await writer.drain()
        return True

    def _other(self, path: str) -> tuple[int, str, bytes]:
        """The answer to a GET of any other path (status, content type, body)."""
        return 404, "application/json", b'{"detail":"Not Found"}'

    def _usage(self, body: dict, n: int) -> dict:
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 10
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def _generate(self, path: str, body: dict, writer, mode: str) -> bool:
        chat = path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or self.tokens)
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": " w" * n}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": " w" * n, "logprobs": None, "finish_reason": "length"}
            out = {"id": "cmpl-fake", "object": obj, "created": 0, "model": body.get("model"), "choices": [choice],
                   "usage": self._usage(body, n)}
            self._send(writer, 200, "application/json", json.dumps(out).encode())
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for i in range(n):
                delta = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
                choice = {"index": 0, **delta, "logprobs": None, "finish_reason": "length" if i == n - 1 else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [100 + i]
                event = {"id": "cmpl-fake", "object": f"{obj}.chunk" if chat else obj, "created": 0, "model": body.get("model"),
                         "choices": [choice]}
                writer.write(_chunked(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"))
                await writer.drain()
                if mode == "die":
                    return False
                await asyncio.sleep(self.token_delay_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "cmpl-fake", "object": obj, "created": 0, "model": body.get("model"), "choices": [],
                         "usage": self._usage(body, n)}
                writer.write(_chunked(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"))
            writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.disconnected += 1
            return False
        return True
