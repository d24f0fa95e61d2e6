"""Tunables of the vLLM engine and how they become vLLM's engine arguments (pure).

Two device cases (``VLLMEngineConfig.engine_args``):

* CUDA, the production case: vLLM sizes the KV pool from its memory profiling
  (``gpu_memory_utilization``, vLLM's default unless set) unless the operator pins
  ``num_blocks``; CUDA graphs are captured unless ``enforce_eager``; ``tensor_parallel_size``
  GPUs per engine (the Ray actor asks for as many: ``replica/actor.py``); the context is
  the model's unless ``max_model_len`` is given.
* CPU (tests, laptops): explicit sizing, eager, one worker in the engine-core process.

Any other vLLM engine argument goes through ``vllm_args``; its keys are checked against
vLLM's own ``EngineArgs`` when the engine starts (one line naming the bad key).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from unicache.replica.eviction.registry import policy_names

NATIVE_POLICY = "vllm"
"""``eviction_policy`` value that keeps vLLM's own free-block queue (its LRU), unchanged."""

SCHEDULER_CLS = "unicache.replica.engines.vllm.scheduler.UniCacheScheduler"
LIVE_UNSUPPORTED = frozenset({"opt"})  # needs the future: simulator only
DEFAULT_CPU_NUM_BLOCKS = 1024
"""The CPU pool when ``num_blocks`` is 0 (on CUDA, 0 lets vLLM's memory profiling size it)."""

# vLLM engine arguments UniCache sets itself: a ``vllm_args`` key among them is refused,
# naming the setting to use instead (None: UniCache needs it as it is).
OWNED_ARGS: dict[str, str | None] = {
    "model": "checkpoint (--model)", "tokenizer": "checkpoint (--model)", "served_model_name": "served_model_name",
    "block_size": "block_size", "num_gpu_blocks_override": "num_blocks", "dtype": "dtype", "seed": "seed",
    "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
    "enforce_eager": "enforce_eager", "tensor_parallel_size": "tensor_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization", "enable_prefix_caching": None, "kv_events_config": None,
    "additional_config": None, "scheduler_cls": None, "disable_log_stats": None, "distributed_executor_backend": None,
}


@dataclass(slots=True)
class VLLMEngineConfig:
    """One vLLM engine inside a replica.

    Attributes:
        model: local Hugging Face model directory (config.json, safetensors, tokenizer.json,
            tokenizer_config.json). Nothing is downloaded.
        served_model_name: the name clients use (default: the directory's name).
        block_size: tokens per KV block (vLLM's CPU attention needs a multiple of 32).
        num_blocks: usable KV blocks in vLLM's pool (vLLM adds its null block); 0: on
            CUDA vLLM's memory profiling sizes the pool, on CPU ``DEFAULT_CPU_NUM_BLOCKS``.
        gpu_memory_utilization: share of each GPU vLLM may take (weights, activations,
            CUDA graphs, KV pool); None: vLLM's default. CUDA only.
        tensor_parallel_size: GPUs one engine spans (tensor parallelism).
        enforce_eager: no CUDA graphs (slower decode; faster start). CPU is always eager.
        vllm_args: any other vLLM engine argument (``AsyncEngineArgs`` keyword), passed
            through; checked against vLLM's ``EngineArgs`` fields at start.
        eviction_policy: a registry policy deciding vLLM's victims, or ``"vllm"`` for
            vLLM's own order untouched.
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda".
        dtype: vLLM dtype ("auto", "float32", "bfloat16", "float16").
        max_num_seqs / max_num_batched_tokens: vLLM scheduler limits.
        max_model_len: longest prompt + output (None: the model's; on CPU and with a
            pinned pool, capped by the pool).
        max_waiting: most accepted requests without output yet; one more is refused at
            once (gRPC RESOURCE_EXHAUSTED). None: unbounded.
        seed: vLLM's seed.
        ipc_dir: directory of the ipc:// sockets (events, replay, pool status); the
            engine makes a private temporary one when None.
    """

    model: str
    served_model_name: str = ""
    block_size: int = 32
    num_blocks: int = 0
    eviction_policy: str = "unicache"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting: int | None = 1024
    seed: int = 0
    ipc_dir: str | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    vllm_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("the vllm engine needs --model: a local Hugging Face model directory")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model}: no config.json there (a local Hugging Face model directory is required)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (0: sized by vLLM on CUDA), got {self.num_blocks}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.vllm_args, dict):
            raise ValueError(f"vllm_args must be a mapping of vLLM engine arguments, got {type(self.vllm_args).__name__}")
        for key in self.vllm_args:
            if key in OWNED_ARGS:
                instead = OWNED_ARGS[key]
                raise ValueError(f"vllm_args: {key!r} is set by UniCache" + (f"; use the {instead} setting" if instead else " and cannot be changed"))
        live = sorted(set(policy_names()) - LIVE_UNSUPPORTED) + [NATIVE_POLICY]
        if self.eviction_policy not in live:
            raise ValueError(f"eviction policy {self.eviction_policy!r} cannot run inside vLLM (choose from {', '.join(live)})")

    def pool_blocks(self, device_type: str) -> int | None:
        """Usable blocks the pool is pinned to on ``device_type``, or None: vLLM's memory
        profiling sizes it (CUDA without ``num_blocks``)."""
        if self.num_blocks:
            return self.num_blocks
        return DEFAULT_CPU_NUM_BLOCKS if device_type == "cpu" else None

    def context_length(self, device_type: str = "cpu") -> int | None:
        """``max_model_len``, else the model's ``max_position_embeddings`` capped by a pinned
        pool (vLLM refuses to start when one longest request cannot fit in its pool); None
        (vLLM's own choice: the model's) when vLLM sizes the pool."""
        if self.max_model_len is not None:
            return self.max_model_len
        pool = self.pool_blocks(device_type)
        if pool is None:
            return None
        with open(os.path.join(self.model, "config.json")) as f:
            model_max = int(json.load(f).get("max_position_embeddings") or 2048)
        return min(model_max, pool * self.block_size)

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    def engine_args(self, device_type: str, events_endpoint: str, replay_endpoint: str, status_endpoint: str) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``AsyncEngineArgs`` on ``device_type`` ("cpu" or
        "cuda"; see the module docstring). Raises ValueError naming a ``vllm_args`` key that
        vLLM's ``EngineArgs`` does not have."""
        from vllm.config import KVEventsConfig

        check_vllm_args(self.vllm_args)
        cpu = device_type == "cpu"
        if cpu and self.block_size % 32:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU attention needs a multiple of 32")
        if cpu and self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size}: tensor parallelism needs GPUs")
        pool = self.pool_blocks(device_type)
        args: dict[str, Any] = dict(
            model=self.model,
            served_model_name=[self.name],
            tokenizer=self.model,
            block_size=self.block_size,
            enable_prefix_caching=True,
            dtype=self.dtype,
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            tensor_parallel_size=self.tensor_parallel_size,
            # NOTE: one GPU: the worker inside the engine-core process; several: one worker
            # process per GPU (the Ray actor holds them all, so vLLM needs no placement group).
            distributed_executor_backend="uni" if self.tensor_parallel_size == 1 else "mp",
            # NOTE: stats on: vLLM's Prometheus logger fills the global registry the replica's
            # /metrics serves (replica/runtime.py), so vLLM's own series are exported.
            disable_log_stats=False,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, replay_endpoint=replay_endpoint
            ),
            additional_config={"unicache": {"eviction_policy": self.eviction_policy, "status_endpoint": status_endpoint}},
            scheduler_cls=SCHEDULER_CLS,
        )
        if cpu or self.enforce_eager:
            # NOTE: torch.compile costs minutes per start on a CPU; on CUDA graphs are the
            # fast decode path, off only when asked (vLLM's default is graphs on).
            args["enforce_eager"] = True
        if pool is not None:
            args["num_gpu_blocks_override"] = pool + 1  # vLLM's null block on top
        context = self.context_length(device_type)
        if context is not None:
            args["max_model_len"] = context
        if self.gpu_memory_utilization is not None and not cpu:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if cpu:
            # NOTE: on CPU "gpu_memory_utilization" is the share of host memory vLLM reserves
            # and checks at start; the KV pool is sized by num_gpu_blocks_override instead.
            args.update(gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 * 1024 * 1024)
        args.update(self.vllm_args)
        return args


def check_vllm_args(vllm_args: dict[str, Any]) -> None:
    """Raise ValueError (one line) for a key that is no field of vLLM's ``EngineArgs``."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for key in vllm_args:
        if key not in known:
            raise ValueError(f"vllm_args: {key!r} is not a vLLM engine argument (see `vllm serve --help`, as snake_case)")
