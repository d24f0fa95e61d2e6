"""The model's architecture record, kept free of torch so settings and CLIs import it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field


class CheckpointError(ValueError):
    """A checkpoint the built-in engine cannot serve exactly (the message names the key)."""


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters, as transformers' standardized ``rope_parameters``.

    ``rope_type`` is one of ``rope.ROPE_TYPES``. The other fields are read only by the
    types that use them (``factor``: linear, dynamic, llama3, yarn; ``low_freq_factor``,
    ``high_freq_factor``: llama3; ``original_max_position``: llama3, yarn; the rest: yarn),
    with transformers' defaults (yarn: ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` True,
    ``attention_factor`` from ``factor``/``mscale``; a None yarn ``factor`` means
    ``max_position / original_max_position``).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(slots=True)
class ModelConfig:
    """Architecture. The defaults are a small model that prefills 2,000 tokens quickly on CPU.

    ``qkv_bias``/``o_bias``/``mlp_bias`` put biases on those projections (Llama's
    ``attention_bias`` sets the first two, Qwen2 has q/k/v bias only). ``sliding_window`` is
    the window (in keys, the query's own included, as transformers' mask) of the layers in
    ``sliding_layers`` (None: all layers); no window: every layer attends to its whole
    context. ``architecture`` is the HF ``model_type``.
    """

    vocab_size: int = 259
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 688
    max_position: int = 4096
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    architecture: str = "llama"
    init_std: float = 0.1  # large enough that greedy decoding of random weights does not collapse

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None when it attends to its whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.dim_per_head % 2:
            raise ValueError("head_dim must be even (rotary embedding)")


def _tiny() -> ModelConfig:
    return ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=2048)


# Named architectures for the seeded random model (``ReplicaSettings.model_preset``):
# "default" is ``ModelConfig()``; "tiny" (2 layers, hidden 64) starts and decodes fast,
# for fault, load and CI tests where the model's quality does not matter.
MODEL_PRESETS = {"default": ModelConfig, "tiny": _tiny}


def model_preset(name: str) -> ModelConfig:
    """The preset's ``ModelConfig``; ValueError names the known presets."""
    try:
        return MODEL_PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}") from None
