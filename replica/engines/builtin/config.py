"""Engine configuration: one dataclass of documented tunables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from unicache.replica.engines.builtin.model_config import ModelConfig


@dataclass(slots=True)
class EngineConfig:
    """Tunables of one replica engine.

    Attributes:
        model: architecture of the seeded random model (ignored when ``checkpoint`` is set).
        checkpoint: local directory with a Llama-format ``config.json`` + ``*.safetensors``.
        tokenizer: path to a Hugging Face ``tokenizer.json`` (or a directory holding one);
            None selects the byte-level tokenizer. With a checkpoint directory that holds a
            tokenizer.json and no explicit path, that file is used.
        num_blocks: KV blocks in the cache (``num_gpu_blocks`` is an alias that wins when set).
        block_size: tokens per KV block.
        eviction_policy: registered eviction policy name (an unknown name fails at start,
            listing the registered ones).
        enable_prefix_caching: False gives a cold cache on every request (for comparisons).
        device: "auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N".
        dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "float64",
            "bfloat16" or "float16".
        max_num_seqs: most sequences (samples) running at once.
        max_num_batched_tokens: most tokens computed in one step (prefills are chunked).
        max_model_len: longest prompt + output (None: the model's max_position).
        admission_watermark: fraction of the cache kept free when admitting a request
            while others run (vLLM's 1%), to avoid admit-then-preempt thrash.
        max_n: largest ``n`` accepted per request (also capped by ``max_num_seqs``).
        max_waiting: most requests accepted but not yet started (no output yet); one more
            is refused at once with ``EngineInputError("exhausted")`` (gRPC
            RESOURCE_EXHAUSTED), so overload is shed instead of queued without bound.
            None: unbounded.
        seed: seeds the random weights and the sampler of requests without a seed.
        host_blocks: KV blocks of the host-memory tier under the pool (0: none). GPU victims
            are demoted to it and prefix matches promote them back before prefill.
        host_eviction_policy: the host tier's registered eviction policy (default
            unicache: the GPU UniCache's demotion order, kept per class queue; lru is what
            vLLM's and LMCache's offloading do).
        cpu_threads: torch intra-op threads for a CPU engine (process-wide); None keeps
            torch's default. On a crowded host 1 is often fastest (no spinning OpenMP peers).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: str | None = None
    tokenizer: str | None = None
    num_blocks: int = 1024
    num_gpu_blocks: int | None = None
    block_size: int = 16
    eviction_policy: str = "unicache"
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    admission_watermark: float = 0.01
    max_n: int = 16
    max_waiting: int | None = 1024
    seed: int = 0
    cpu_threads: int | None = None
    host_blocks: int = 0
    host_eviction_policy: str = "unicache"

    def __post_init__(self) -> None:
        positive = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_n")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.host_blocks < 0:
            raise ValueError(f"EngineConfig.host_blocks must be >= 0, got {self.host_blocks}")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"EngineConfig.max_waiting must be >= 1 or None, got {self.max_waiting}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"EngineConfig.num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(f"EngineConfig.admission_watermark must be in [0, 1), got {self.admission_watermark}")

    def tokenizer_path(self) -> str | None:
        """Explicit tokenizer, else a checkpoint's own tokenizer.json, else None (bytes)."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.checkpoint is not None and os.path.exists(os.path.join(self.checkpoint, "tokenizer.json")):
            return os.path.join(self.checkpoint, "tokenizer.json")
        return None

    @property
    def total_blocks(self) -> int:
        return self.num_gpu_blocks if self.num_gpu_blocks is not None else self.num_blocks
