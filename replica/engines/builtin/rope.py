"""Rotary position tables for each rope type, computed the way transformers computes them.

A rope type maps ``(RopeConfig, head_dim, max_position)`` to ``(inv_freq, attention_scaling)``;
the tables are then ``cos/sin(position * inv_freq) * attention_scaling`` in float32 with
the rotate-half layout (frequencies repeated twice), cast to the model's dtype per forward.

Invariants:
    * Every value is computed in float32 with the same operation order as transformers'
      ``modeling_rope_utils`` (5.x), so the tables agree with it bit for bit on a given
      torch build; float64 would be "more exact" but would differ from the reference.
    * ``dynamic`` (NTK) equals ``default`` for every sequence up to
      ``max_position_embeddings``: transformers rescales only past it, and the engine never
      serves past it (``LLMEngine.max_model_len`` is capped there), so one static table is
      exact for the whole served context.
    * Only the types in ``ROPE_TYPES`` exist; ``model_config.RopeConfig`` refuses others at load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from unicache.replica.engines.builtin.model_config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _default(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, dim), 1.0


def _linear(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    # Dividing the frequencies by the factor is dividing the positions by it.
    return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0


def _dynamic(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    # NTK base for seq_len = max_position (see the module docstring): the multiplier is 1.
    seq_len = max_position
    base = rope.theta * ((rope.factor * seq_len / max_position) - (rope.factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    old_len = rope.original_max_position
    factor = rope.factor if rope.factor is not None else max_position / old_len
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention


ROPE_TYPES: dict[str, Callable[[RopeConfig, int, int], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_tables(rope: RopeConfig, head_dim: int, max_position: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``/``sin`` tables ``[max_position, head_dim]`` for positions ``0..max_position-1``."""
    inv_freq, scaling = ROPE_TYPES[rope.rope_type](rope, head_dim, max_position)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)
