"""Tunables of the vLLM engine and how they become vLLM's engine arguments (pure)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from unicache.replica.eviction.registry import policy_names

NATIVE_POLICY = "vllm"
"""``eviction_policy`` value that keeps vLLM's own free-block queue (its LRU), unchanged."""

SCHEDULER_CLS = "unicache.replica.vllm_engine.scheduler.UniCacheScheduler"
LIVE_UNSUPPORTED = frozenset({"opt"})  # needs the future: simulator only


@dataclass(slots=True)
class VLLMEngineConfig:
    """One vLLM engine inside a replica.

    Attributes:
        model: local Hugging Face model directory (config.json, safetensors, tokenizer.json,
            tokenizer_config.json). Nothing is downloaded.
        served_model_name: the name clients use (default: the directory's name).
        block_size: tokens per KV block (vLLM's CPU attention needs a multiple of 32).
        num_blocks: usable KV blocks in vLLM's pool (vLLM adds its null block).
        eviction_policy: a registry policy deciding vLLM's victims, or ``"vllm"`` for
            vLLM's own order untouched.
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda".
        dtype: vLLM dtype ("auto", "float32", "bfloat16", "float16").
        max_num_seqs / max_num_batched_tokens: vLLM scheduler limits.
        max_model_len: longest prompt + output (None: the model's).
        max_waiting: most accepted requests without output yet; one more is refused at
            once (gRPC RESOURCE_EXHAUSTED). None: unbounded.
        seed: vLLM's seed.
        ipc_dir: directory of the ipc:// sockets (events, replay, pool status); the
            engine makes a private temporary one when None.
    """

    model: str
    served_model_name: str = ""
    block_size: int = 32
    num_blocks: int = 1024
    eviction_policy: str = "unicache"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting: int | None = 1024
    seed: int = 0
    ipc_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("the vllm engine needs --model: a local Hugging Face model directory")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model}: no config.json there (a local Hugging Face model directory is required)")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        live = sorted(set(policy_names()) - LIVE_UNSUPPORTED) + [NATIVE_POLICY]
        if self.eviction_policy not in live:
            raise ValueError(f"eviction policy {self.eviction_policy!r} cannot run inside vLLM (choose from {', '.join(live)})")

    def context_length(self) -> int:
        """``max_model_len``, else the model's ``max_position_embeddings``, capped by the pool
        (vLLM refuses to start when one longest request cannot fit in its pool)."""
        if self.max_model_len is not None:
            return self.max_model_len
        with open(os.path.join(self.model, "config.json")) as f:
            model_max = int(json.load(f).get("max_position_embeddings") or 2048)
        return min(model_max, self.num_blocks * self.block_size)

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    def engine_args(self, device_type: str, events_endpoint: str, replay_endpoint: str, status_endpoint: str) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``AsyncEngineArgs``."""
        from vllm.config import KVEventsConfig

        if device_type == "cpu" and self.block_size % 32:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU attention needs a multiple of 32")
        args: dict[str, Any] = dict(
            model=self.model,
            served_model_name=[self.name],
            tokenizer=self.model,
            block_size=self.block_size,
            num_gpu_blocks_override=self.num_blocks + 1,
            enable_prefix_caching=True,
            dtype=self.dtype,
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.context_length(),
            enforce_eager=True,  # NOTE: torch.compile costs minutes per start on a CPU
            distributed_executor_backend="uni",  # the worker inside the engine-core process
            # NOTE: stats on: vLLM's Prometheus logger fills the global registry the replica's
            # /metrics serves (replica/runtime.py), so vLLM's own series are exported.
            disable_log_stats=False,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, replay_endpoint=replay_endpoint
            ),
            additional_config={"unicache": {"eviction_policy": self.eviction_policy, "status_endpoint": status_endpoint}},
            scheduler_cls=SCHEDULER_CLS,
        )
        if device_type == "cpu":
            # NOTE: on CPU "gpu_memory_utilization" is the share of host memory vLLM reserves
            # and checks at start; the KV pool is sized by num_gpu_blocks_override instead.
            args.update(gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 * 1024 * 1024)
        return args
