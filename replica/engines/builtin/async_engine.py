"""``AsyncEngine``: the engine behind an asyncio surface (what the gRPC servicer uses).

One background thread runs the step loop (torch releases the GIL during compute); it
hands outputs to the event loop with ``loop.call_soon_threadsafe``. Requests and aborts
reach the thread through a locked inbox, so only that thread mutates the scheduler and
store. Nothing here blocks the event loop: ``start``/``stop`` build and join in worker
threads.

Invariants:
    * A request whose consumer stops iterating (``aclose``, cancellation, error) is
      aborted and its blocks freed before the step thread runs another step for it.
    * ``num_waiting`` counts the requests accepted by ``generate`` that have produced no
      output yet (queued or still in prefill); it never exceeds ``config.max_waiting``:
      one more is refused with ``EngineInputError("exhausted")`` before it is queued.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_events import KVEvent
from unicache.contract.tokenizer import load_tokenizer
from unicache.replica.engines.api import CacheStateInfo, EngineInputError, EngineLoad, EngineOutput, EngineRequest
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.engine import LLMEngine, resolve_device


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Async facade over ``LLMEngine``; see the module docstring.

    Args:
        config: engine tunables; the model is built by ``start()``.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = str(resolve_device(config.device))
        self.block_size = config.block_size
        self.tokenizer = load_tokenizer(config.tokenizer_path())
        self.engine: LLMEngine | None = None
        self._streams: dict[str, _Stream] = {}
        self._inbox_lock = threading.Lock()
        self._wake = threading.Condition(self._inbox_lock)
        self._new: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._waiting = 0  # accepted requests without output yet (event-loop thread only)

    @property
    def max_model_len(self) -> int:
        """The context it serves, prompt + output (0 before ``start()``): announced in the
        replica's heartbeat."""
        return self.engine.max_model_len if self.engine is not None else 0

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        self.engine = await asyncio.to_thread(LLMEngine, self.config)
        self.device = str(self.engine.device)
        self.tokenizer = self.engine.tokenizer
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="unicache-engine-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None
        with self._wake:
            late, self._new = self._new, []
            self._aborts.clear()
        for req in late:  # submitted while the thread was exiting
            self._deliver_error(req.request_id, RuntimeError("engine stopped"))

    # -------------------------------------------------------------- requests
    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream outputs of every sample; the last output of each sample has ``finished``.

        Raises ``EngineInputError`` before yielding anything if the request is invalid, and
        re-raises an engine failure that hit the request.
        """
        engine = self._require_started()
        if self._thread is None:
            raise RuntimeError("AsyncEngine is stopped")
        engine.validate(req)
        if req.request_id in self._streams:
            raise EngineInputError("invalid", f"request id {req.request_id!r} is already in flight")
        limit = self.config.max_waiting
        if limit is not None and self._waiting >= limit:
            raise EngineInputError(
                "exhausted", f"replica overloaded: {self._waiting} requests waiting (max_waiting={limit}); retry later", overloaded=True
            )
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[req.request_id] = stream
        with self._wake:
            self._new.append(req)
            self._wake.notify()
        remaining = req.sampling.n
        self._waiting += 1
        waiting = True
        try:
            while remaining:
                item = await stream.queue.get()
                if waiting:
                    self._waiting -= 1
                    waiting = False
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if waiting:
                self._waiting -= 1
            self._streams.pop(req.request_id, None)
            if remaining:
                with self._wake:
                    self._aborts.append(req.request_id)
                    self._wake.notify()

    @property
    def num_waiting(self) -> int:
        """Requests accepted by ``generate`` without output yet (see the module invariants)."""
        return self._waiting

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------- snapshots
    def load(self) -> EngineLoad:
        if self.engine is None:
            return EngineLoad(0, 0, 0)
        return self.engine.load()

    def cache_state(self) -> CacheStateInfo:
        return self._require_started().cache_state()

    def take_events(self) -> list[KVEvent]:
        return self._require_started().take_events()

    def cached_hashes(self) -> list[BlockHash]:
        return self._require_started().cached_hashes()

    def host_hashes(self) -> list[BlockHash]:
        return self._require_started().host_hashes()

    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        return self._require_started().cached_blocks()

    def num_referenced_blocks(self) -> int:
        return self._require_started().num_referenced_blocks()

    def _require_started(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        return self.engine

    # -------------------------------------------------------------- step loop
    def _run(self) -> None:
        engine = self.engine
        assert engine is not None
        while True:
            with self._wake:
                while not (self._new or self._aborts or self._stopping or engine.has_unfinished()):
                    self._wake.wait()
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            for req in new:
                try:
                    engine.add_request(req)
                except EngineInputError as exc:
                    self._deliver_error(req.request_id, exc)
            for rid in aborts:  # after adds: a request cancelled at once is still dropped
                engine.abort(rid)
            if stopping:
                for rid in engine.request_ids():
                    self._deliver(engine.abort(rid))
                return
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - every in-flight request must hear of it
                for rid in engine.fail_all(exc):
                    self._deliver_error(rid, RuntimeError(f"engine step failed: {exc!r}"))
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                _call_soon(stream, out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream, exc)


def _call_soon(stream: _Stream, item: object) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # the consumer's event loop is closed: nobody is listening any more
