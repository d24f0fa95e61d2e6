"""Tiny random-weight Hugging Face checkpoints written with transformers itself.

``write_case(name, path)`` builds the transformers config of ``CASES[name]``, a model with
seeded random weights (every parameter drawn, biases and norms included, so each one
matters to the logits), and ``save_pretrained`` writes config.json + model.safetensors.
``hf_logits``/``hf_greedy`` are the reference: transformers' own forward, full recompute;
``paged_logits`` runs our model through its serving path (paged KV, prefix then suffix
then decode). ``REFUSED`` lists config.json edits the engine must refuse at load, with the
start of the one-line message it must give. Used by tests/replica/test_engine_hf_parity.py and
bench/hf_parity.py; needs transformers (the ``dev`` extra).
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
    "mistral-window-8": Case("mistral", dict(sliding_window=8)),
    "qwen2-window-layer1": Case("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
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


def paged_logits(model, chunks: list[tuple[list[int], int, int]], block_size: int = 4) -> torch.Tensor:
    """Logits of ``(tokens, start, end)`` chunks run in order through the paged serving path.

    One sequence over scattered KV blocks: a later chunk reads the K/V the earlier ones wrote.
    """
    from unicache.replica.engines.builtin.attention import build_metadata
    from unicache.replica.kv.torch_storage import TorchKVStorage

    c = model.config
    end_max = max(end for _, _, end in chunks)
    n_blocks = -(-end_max // block_size)
    storage = TorchKVStorage(c.num_layers, 3 * n_blocks + 1, block_size, c.num_kv_heads, c.dim_per_head)
    table = torch.randperm(3 * n_blocks + 1, generator=torch.Generator().manual_seed(0))[:n_blocks].tolist()  # scattered
    out = []
    for toks, start, end in chunks:
        meta = build_metadata([(table, start, end)], block_size, torch.device("cpu"), c.sliding_window)
        hidden = model(torch.tensor(toks[start:end]), torch.arange(start, end), storage, meta)
        out.append(model.logits(hidden))
    return torch.cat(out)


def _set(**kw):
    return lambda c: c.update(kw)


def _rope(**kw):
    return lambda c: c["rope_parameters"].update(kw)


# config.json edits of the "llama-default" case -> the start of the engine's refusal.
REFUSED = {
    "model_type": (_set(model_type="gpt2"), "config.json model_type 'gpt2' is not supported by the built-in engine (supported: llama, mistral, qwen2)"),
    "architectures": (_set(architectures=["LlamaForSequenceClassification"]), "config.json architectures ['LlamaForSequenceClassification']"),
    "hidden_act": (_set(hidden_act="gelu"), "config.json hidden_act 'gelu' is not supported"),
    "rope_type": (_rope(rope_type="longrope"), "config.json rope_parameters.rope_type 'longrope' is not supported by the built-in engine (supported: default, linear, dynamic, llama3, yarn)"),
    "rope_scaling": (_set(rope_scaling={"type": "su", "factor": 2.0}), "config.json rope_scaling.rope_type 'su' is not supported"),
    "rope_key": (_rope(rope_type="llama3", factor=8.0, high_freq_factor=4.0), "config.json rope_parameters for rope_type 'llama3' lacks 'low_freq_factor'"),
    "nested_rope": (_set(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "config.json rope_parameters is nested per layer type"),
    "partial_rotary_factor": (_set(partial_rotary_factor=0.5), "config.json partial_rotary_factor=0.5"),
    "quantization_config": (_set(quantization_config={"quant_method": "gptq"}), "config.json quantization_config is set"),
    "num_key_value_heads": (_set(num_key_value_heads=3), "config.json num_key_value_heads=3 does not divide num_attention_heads=4"),
    "shape": (_set(intermediate_size=96), "checkpoint does not match config.json: size mismatch for model.layers.0.mlp.gate_proj.weight"),
}


def prompt(n: int, seed: int = 1, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()
