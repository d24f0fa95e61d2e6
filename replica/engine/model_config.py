"""The model's architecture record, kept free of torch so settings and CLIs import it cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ModelConfig:
    """Architecture. The defaults are a small model that prefills 2,000 tokens quickly on CPU."""

    vocab_size: int = 259
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 688
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    init_std: float = 0.1  # large enough that greedy decoding of random weights does not collapse

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

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
