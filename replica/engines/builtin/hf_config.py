"""A Hugging Face ``config.json`` read the way transformers reads it, or refused by key.

Supported: ``model_type`` llama, mistral and qwen2 with ``architectures`` their
``*ForCausalLM``; ``hidden_act`` silu; rope from ``rope_scaling`` (transformers 4 layout,
``type`` or ``rope_type``) or ``rope_parameters`` (transformers 5 layout, ``rope_theta``
inside), types default, linear, dynamic, llama3, yarn; explicit ``head_dim``; tied
embeddings; Llama's ``attention_bias``/``mlp_bias``; Qwen2's q/k/v bias; sliding windows
(Mistral's ``sliding_window`` on every layer, Qwen2's ``use_sliding_window`` on the layers
``max_window_layers``/``layer_types`` name), masked as transformers masks them.

Invariants:
    * A missing key takes the default of that architecture's transformers config class
      (e.g. ``rms_norm_eps`` 1e-6, Mistral's ``sliding_window`` 4096), so a sparse
      config.json means what it means to transformers.
    * A config whose computation the engine cannot reproduce raises ``CheckpointError``
      with one line that names the key; keys transformers itself ignores for the
      architecture (e.g. ``attention_bias`` for Qwen2) are ignored here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from unicache.replica.engines.builtin.model_config import CheckpointError, ModelConfig, RopeConfig
from unicache.replica.engines.builtin.rope import ROPE_TYPES

__all__ = ["ARCHITECTURES", "CheckpointError", "config_from_hf", "config_to_hf"]

@dataclass(frozen=True, slots=True)
class Architecture:
    """One supported ``model_type``: its class name, config defaults and projection biases."""

    causal_lm: str
    defaults: dict[str, Any]
    biases: Callable[[dict], tuple[bool, bool, bool]]  # (q/k/v, o, mlp) from the merged config
    sliding_window: Callable[[dict], tuple[int | None, tuple[int, ...] | None]]  # (window, its layers; None: all)


def _llama_biases(c: dict) -> tuple[bool, bool, bool]:
    return bool(c["attention_bias"]), bool(c["attention_bias"]), bool(c["mlp_bias"])


def _mistral_window(c: dict) -> tuple[int | None, tuple[int, ...] | None]:
    return c["sliding_window"], None


def _qwen2_window(c: dict) -> tuple[int | None, tuple[int, ...] | None]:
    window = c["sliding_window"] if c["use_sliding_window"] else None
    if window is None:
        return None, None
    types = c.get("layer_types") or [
        "sliding_attention" if i >= c["max_window_layers"] else "full_attention" for i in range(c["num_hidden_layers"])
    ]
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, layers) if layers else (None, None)


_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None}

# Defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config (5.x) for every key read here.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "LlamaForCausalLM",
        {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
         "attention_bias": False, "mlp_bias": False},
        _llama_biases,
        lambda c: (None, None),
    ),
    "mistral": Architecture(
        "MistralForCausalLM",
        {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
         "sliding_window": 4096},
        lambda c: (False, False, False),
        _mistral_window,
    ),
    "qwen2": Architecture(
        "Qwen2ForCausalLM",
        {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None},
        lambda c: (True, False, False),
        _qwen2_window,
    ),
}

# Keys each rope type reads (besides rope_type and rope_theta); transformers warns about others.
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}
_REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}
assert set(_ROPE_KEYS) == set(ROPE_TYPES), "every rope type of rope.py needs its keys here"

# Keys that change what transformers computes and that the engine does not implement.
_REFUSED_KEYS = ("quantization_config",)


def _rope_from_hf(c: dict) -> RopeConfig:
    """Standardize rope as transformers' ``RotaryEmbeddingConfigMixin`` does, then check it."""
    if c.get("rope_scaling"):
        key, params = "rope_scaling", dict(c["rope_scaling"])
    else:
        key, params = "rope_parameters", dict(c.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"config.json {key} is nested per layer type; the built-in engine supports one rope for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"config.json {key}.rope_type {rope_type!r} is not supported by the built-in engine "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    prf = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise CheckpointError(f"config.json partial_rotary_factor={prf}: the built-in engine rotates whole heads only")
    for name in _REQUIRED_ROPE_KEYS.get(rope_type, ()):
        if name not in params:
            raise CheckpointError(f"config.json {key} for rope_type {rope_type!r} lacks {name!r}")
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    original = None
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins over the rope dict's.
        original = c.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = int(original or c["max_position_embeddings"])
    if rope_type == "llama3" and not float(params["high_freq_factor"]) > float(params["low_freq_factor"]):
        raise CheckpointError(f"config.json {key}.high_freq_factor must be greater than low_freq_factor")

    def num(name: str) -> float | None:
        v = params.get(name)
        return None if v is None or name not in _ROPE_KEYS[rope_type] else float(v)

    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=num("factor"),
        low_freq_factor=num("low_freq_factor"),
        high_freq_factor=num("high_freq_factor"),
        original_max_position=original,
        attention_factor=num("attention_factor"),
        beta_fast=num("beta_fast"),
        beta_slow=num("beta_slow"),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """The ``ModelConfig`` transformers would build from ``hf`` (a parsed config.json).

    Raises:
        CheckpointError: one line naming the key the engine cannot reproduce.
    """
    model_type = hf.get("model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise CheckpointError(
            f"config.json model_type {model_type!r} is not supported by the built-in engine "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    archs = hf.get("architectures")
    if archs is not None and list(archs) != [arch.causal_lm]:
        raise CheckpointError(f"config.json architectures {archs!r}: the built-in engine serves only [{arch.causal_lm!r}]")
    for key in _REFUSED_KEYS:
        if hf.get(key) is not None:
            raise CheckpointError(f"config.json {key} is set: the built-in engine serves unquantized weights only")
    # NOTE: an explicit null stays null (Mistral's "sliding_window": null means no window).
    c = {**arch.defaults, **hf}
    if c["hidden_act"] != "silu":
        raise CheckpointError(f"config.json hidden_act {c['hidden_act']!r} is not supported by the built-in engine (only 'silu')")
    heads = int(c["num_attention_heads"])
    kv_heads = int(c["num_key_value_heads"] or heads)
    if heads % kv_heads:
        raise CheckpointError(f"config.json num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    head_dim = c.get("head_dim") or int(c["hidden_size"]) // heads
    if head_dim % 2:
        raise CheckpointError(f"config.json head_dim={head_dim} is odd; rotary embedding needs an even head_dim")
    qkv_bias, o_bias, mlp_bias = arch.biases(c)
    window, window_layers = arch.sliding_window(c)
    if window is not None and int(window) < 1:
        raise CheckpointError(f"config.json sliding_window={window} must be >= 1")
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=int(c["intermediate_size"]),
        max_position=int(c["max_position_embeddings"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        head_dim=int(head_dim),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        rope=_rope_from_hf(c),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        sliding_window=None if window is None else int(window),
        sliding_layers=window_layers,
        architecture=model_type,
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """A transformers 5 style config.json for ``cfg`` (tests and tooling; Llama layout)."""
    rope = cfg.rope
    params: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    for key in sorted(_ROPE_KEYS[rope.rope_type]):
        field_name = "original_max_position" if key == "original_max_position_embeddings" else key
        val = getattr(rope, field_name)
        if val is not None:
            params[key] = val
    out = {
        "architectures": [ARCHITECTURES[cfg.architecture].causal_lm],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position,
        "rope_parameters": params,
        "rms_norm_eps": cfg.rms_norm_eps,
        "head_dim": cfg.dim_per_head,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if cfg.architecture == "llama":
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("a Llama config.json has one attention_bias for q/k/v and o")
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.architecture == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out
