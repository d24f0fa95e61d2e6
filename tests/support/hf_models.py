"""Tiny random-weight Hugging Face checkpoints written with transformers itself.

``write_case(name, path)`` builds the transformers config of ``CASES[name]``, a model with
seeded random weights (every parameter drawn, biases and norms included, so each one
matters to the logits), and ``save_pretrained`` writes config.json + model.safetensors.
``hf_logits``/``hf_greedy`` are the reference: transformers' own forward, full recompute.
Used by tests/test_engine_hf_parity.py and bench/hf_parity.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SHAPE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)


@dataclass(frozen=True)
class Case:
    """One checkpoint: transformers ``model_type``, config kwargs, and an optional config.json rewrite.

    ``v4_rope``: rewrite config.json in transformers 4's layout (``rope_scaling`` with
    ``type``, top-level ``rope_theta``) after saving, as older checkpoints carry it.
    """

    model_type: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    v4_rope: bool = False


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

CASES: dict[str, Case] = {
    "llama-default": Case("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "llama-linear": Case("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-dynamic": Case("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-llama3": Case("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-llama3-rope_scaling": Case("llama", dict(rope_parameters=LLAMA3_ROPE), v4_rope=True),
    "llama-yarn": Case("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                          original_max_position_embeddings=64))),
    "llama-yarn-mscale": Case("llama", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
        mscale_all_dim=0.5, beta_fast=16.0, beta_slow=2.0, truncate=False))),
    "llama-tied": Case("llama", dict(tie_word_embeddings=True)),
    "llama-head_dim": Case("llama", dict(head_dim=32)),
    "llama-bias": Case("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": Case("qwen2", dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "qwen2-tied": Case("qwen2", dict(tie_word_embeddings=True)),
    "mistral": Case("mistral", dict(sliding_window=None, head_dim=32)),
    "mistral-window-4096": Case("mistral", dict(sliding_window=4096)),
}


def _config(case: Case):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}
    return cls[case.model_type](**{**SHAPE, **case.kwargs})


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.25 * noise)


def write_case(name: str, path: str, seed: int = 0, **overrides) -> str:
    """Write ``CASES[name]`` (config kwargs updated by ``overrides``) to ``path``; returns ``path``."""
    import transformers

    base = CASES[name]
    case = Case(base.model_type, {**base.kwargs, **overrides}, base.v4_rope)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(case), dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path)
    if case.v4_rope:
        edit_config(path, _to_v4_rope)
    return path


def _to_v4_rope(cfg: dict) -> None:
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params


def edit_config(path: str, edit) -> None:
    """Apply ``edit(config_dict)`` to ``path/config.json`` in place."""
    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8") as f:
        cfg = json.load(f)
    edit(cfg)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def load_hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` (float32) for one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers, recomputing the whole sequence each step (no EOS stop)."""
    seq = list(ids)
    for _ in range(max_new_tokens):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def prompt(n: int, seed: int = 1, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()
