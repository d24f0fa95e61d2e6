"""``VLLMEngine``: vLLM's V1 ``AsyncLLM`` behind the replica's ``ServingEngine`` interface.

vLLM runs in-process through its Python API (never its CLI); its engine core is a child
process it manages. Three local ipc:// sockets in a private directory connect the two:
vLLM's KV events (PUB) and their replay (ROUTER), which ``take_events`` translates into our
events and hashes (replica/engines/vllm/kv_events.py), and the pool status published by our
scheduler (replica/engines/vllm/status.py), which feeds ``cache_state``.

Invariants:
    * ``generate`` validates before anything reaches vLLM: a request vLLM would refuse, or
      one asking for something this engine does not do (an adapter), raises
      ``EngineInputError`` naming the field; closing the iterator early aborts the request
      in vLLM (AsyncLLM aborts a generator that is closed or cancelled).
    * ``load``/``cache_state`` are computed from counters and the newest status snapshot:
      they never wait on vLLM.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.replica.engines.api import (
    CacheStateInfo,
    EngineInputError,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    Usage,
)
from unicache.contract.kv_events import AllBlocksCleared, KVEvent
from unicache.contract.tokenizer import load_tokenizer
from unicache.replica.engines.builtin.validation import check_request
from unicache.replica.engines.vllm.config import VLLMEngineConfig, check_vllm_args
from unicache.replica.engines.vllm.outputs import token_logprobs
from unicache.replica.engines.vllm.request_meta import class_to_extra_args, salt_to_vllm
from unicache.replica.engines.vllm.version import check_vllm_version

MAX_N = 16
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def phase_times(stats, first_token_s: float) -> tuple[float, float]:
    """(queue, prefill) seconds of a request from vLLM's own ``RequestStateStats``: queued
    from the engine core's first QUEUED event to its first SCHEDULED one, prefill from then
    to the first token (preemptions during prefill included), as vLLM's
    ``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds`` measure
    them. Without those stats (vLLM logs none when its stats are off, and none before the
    core has scheduled the request), the queue counts 0 and prefill is ``first_token_s``,
    submission to first token as this process saw it."""
    if stats is None or not stats.queued_ts or not stats.scheduled_ts:
        return 0.0, first_token_s
    queue = max(0.0, stats.scheduled_ts - stats.queued_ts)
    prefill = stats.first_token_ts - stats.scheduled_ts if stats.first_token_ts else first_token_s - queue
    return queue, max(0.0, prefill)


_OWN_RPC_PATHS = {""}  # VLLM_RPC_BASE_PATH values this module set ("": unset)


@dataclass(slots=True)
class _InFlight:
    prompt_tokens: int
    started: bool = False


class VLLMEngine:
    """See the module docstring.

    Args:
        config: the engine's tunables.
    """

    def __init__(self, config: VLLMEngineConfig):
        self.config = config
        self.block_size = config.block_size
        self.device = "cpu"
        self.served_model_name = config.name
        tok_path = os.path.join(config.model, "tokenizer.json")
        self.tokenizer = load_tokenizer(tok_path if os.path.exists(tok_path) else None)
        self._llm = None
        self._events = None
        self._translator = None
        self._status = None
        self._ipc_dir: str | None = None
        self._own_ipc_dir = False
        self._inflight: dict[str, _InFlight] = {}
        self.vocab_size = 0
        self.max_model_len = 0
        self.num_blocks = config.num_blocks  # the pool's usable blocks: known once started

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._llm is not None:
            return
        check_vllm_version()
        check_vllm_args(self.config.vllm_args)  # one line for a bad key, before any process starts
        import torch

        from unicache.replica.engines.vllm.kv_events import EventTranslator, KVEventSubscriber
        from unicache.replica.engines.vllm.status import StatusSubscriber

        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        if self.config.ipc_dir:
            self._ipc_dir = self.config.ipc_dir
        else:
            # NOTE: AF_UNIX paths are capped at 107 bytes: keep the directory short.
            self._ipc_dir, self._own_ipc_dir = tempfile.mkdtemp(prefix="uc-vllm-", dir="/tmp"), True
        ep = {name: f"ipc://{os.path.join(self._ipc_dir, name)}" for name in ("events", "replay", "status")}
        # NOTE: vLLM's own front-end <-> engine-core sockets go to $VLLM_RPC_BASE_PATH (the
        # temp dir by default), where it leaves them; in ours they go with it at stop.
        if os.environ.get("VLLM_RPC_BASE_PATH", "") in _OWN_RPC_PATHS:  # unset, or an engine of ours set it
            os.environ["VLLM_RPC_BASE_PATH"] = self._ipc_dir
            _OWN_RPC_PATHS.add(self._ipc_dir)
        kwargs = self.config.engine_args(device.split(":")[0], ep["events"], ep["replay"], ep["status"])
        self._events = KVEventSubscriber(ep["events"], ep["replay"])
        self._status = StatusSubscriber(ep["status"])
        self._translator = EventTranslator()
        self._llm = await asyncio.to_thread(_build_async_llm, kwargs)
        model_config = self._llm.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.max_model_len = model_config.max_model_len
        # NOTE: with no pinned pool vLLM's profiling sized it; the engine core reports the
        # size (its null block included) back into this process's config.
        self.num_blocks = max(0, (self._llm.vllm_config.cache_config.num_gpu_blocks or 1) - 1)

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        for sock in (self._events, self._status):
            if sock is not None:
                sock.close()
        self._events = self._status = None
        if self._ipc_dir and os.environ.get("VLLM_RPC_BASE_PATH") == self._ipc_dir:
            # NOTE: set by start(); left behind it would send every later vLLM of this
            # process, and every child started after, to a folder that is gone.
            del os.environ["VLLM_RPC_BASE_PATH"]
        if self._own_ipc_dir and self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir, self._own_ipc_dir = None, False

    # -------------------------------------------------------------- requests
    def validate(self, req: EngineRequest) -> None:
        """Raise ``EngineInputError`` for a request this engine will not serve."""
        if req.adapter_id:
            raise EngineInputError("invalid", "adapter_id is not supported by the vllm engine")
        check_request(
            req, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            max_n=min(MAX_N, self.config.max_num_seqs), num_blocks=self.num_blocks, block_size=self.block_size,
        )
        if req.request_id in self._inflight:
            raise EngineInputError("invalid", f"request id {req.request_id!r} is already in flight")

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream every sample's tokens; the last output of each sample has ``finished``."""
        llm = self._require_started()
        self.validate(req)
        limit = self.config.max_waiting
        waiting = sum(1 for f in self._inflight.values() if not f.started)
        if limit is not None and waiting >= limit:
            raise EngineInputError(
                "exhausted", f"replica overloaded: {waiting} requests waiting (max_waiting={limit}); retry later", overloaded=True
            )
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = req.sampling
        params = SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop=list(p.stop) or None,
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            stop_token_ids=list(p.stop_token_ids) or None,
            logprobs=p.logprobs,
            output_kind=RequestOutputKind.DELTA,
            extra_args=class_to_extra_args(req.cls),
        )
        prompt: dict = {"prompt_token_ids": list(req.prompt_token_ids)}
        salt = salt_to_vllm(req.cache_salt)
        if salt:
            prompt["cache_salt"] = salt
        flight = self._inflight[req.request_id] = _InFlight(len(req.prompt_token_ids))
        submitted = time.monotonic()
        first: float | None = None
        completion = [0] * p.n
        stream = llm.generate(prompt, params, req.request_id, session_id=req.cls.session_id)
        try:
            async for out in stream:
                if first is None:
                    first, flight.started = time.monotonic(), True
                for c in out.outputs:
                    completion[c.index] += len(c.token_ids)
                    done = c.finish_reason is not None
                    usage = None
                    if done:
                        queue_s, prefill_s = phase_times(out.metrics, first - submitted)
                        usage = Usage(
                            prompt_tokens=flight.prompt_tokens,
                            cached_tokens=out.num_cached_tokens or 0,
                            completion_tokens=completion[c.index],
                            queue_time_s=queue_s,
                            prefill_time_s=prefill_s,
                        )
                    yield EngineOutput(
                        req.request_id,
                        c.index,
                        list(c.token_ids),
                        c.text,
                        finished=done,
                        finish_reason=_FINISH.get(c.finish_reason, "stop") if done else None,
                        usage=usage,
                        logprobs=token_logprobs(c.token_ids, c.logprobs, p.logprobs),
                    )
        finally:
            self._inflight.pop(req.request_id, None)
            await stream.aclose()

    async def reset_cache(self) -> bool:
        """Drop every cached block no request holds (vLLM's ``reset_prefix_cache``); False
        when some request still holds blocks."""
        return await self._require_started().reset_prefix_cache()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------- snapshots
    def load(self) -> EngineLoad:
        waiting = [f for f in self._inflight.values() if not f.started]
        return EngineLoad(
            running=len(self._inflight) - len(waiting),
            waiting=len(waiting),
            queued_prefill_tokens=sum(f.prompt_tokens for f in waiting),
        )

    def cache_state(self) -> CacheStateInfo:
        self._require_started()
        st = self._status.poll()
        cap = self.num_blocks
        if st is None:  # no step ran yet: an empty pool
            return CacheStateInfo(self.block_size, cap, 0, cap, 0, 0.0, {}, self.config.eviction_policy, 0)
        return st.cache_state(self.block_size)

    def take_events(self) -> list[KVEvent]:
        self._require_started()
        out: list[KVEvent] = []
        batches = self._events.take()
        if self._events.broken:  # lost events: forget what they built, start over
            self._translator.reset()
            out.append(AllBlocksCleared(time.time()))
        for batch in batches:
            out.extend(self._translator.translate(batch))
        return out

    def cached_hashes(self) -> list[BlockHash]:
        """Our hashes of every block vLLM's prefix cache holds, as its events describe it.

        NOTE: events not yet taken are not reflected; the publisher takes events before it
        writes a summary, so a summary and the stream stay consistent.
        """
        self._require_started()
        return self._translator.cached_hashes()

    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """``cached_hashes`` with each block's parent (our hashes), as the events gave them."""
        self._require_started()
        return self._translator.cached_blocks()

    def host_hashes(self) -> list[BlockHash]:
        """Always empty: this engine is single-tier (docs/host_tier.md says why)."""
        return []

    def _require_started(self):
        if self._llm is None:
            raise RuntimeError("VLLMEngine.start() has not been called")
        return self._llm


def _build_async_llm(kwargs: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
