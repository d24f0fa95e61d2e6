"""Load (and, for tests and tools, save) a Llama-format checkpoint from a local directory.

Format: Hugging Face's ``config.json`` plus one or more ``*.safetensors`` files with HF
parameter names (``model.layers.0.self_attn.q_proj.weight`` ...). Our modules use the same
names, so loading is ``load_state_dict`` after reading the tensors. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file, save_file

from unicache.replica.engine.model import LlamaForCausalLM, ModelConfig


class CheckpointError(ValueError):
    """The directory is not a loadable Llama-format checkpoint."""


def config_from_hf(cfg: dict) -> ModelConfig:
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            intermediate_size=cfg["intermediate_size"],
            max_position=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            head_dim=cfg.get("head_dim"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks {exc.args[0]!r}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "head_dim": cfg.dim_per_head,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }


def load_checkpoint(path: str) -> LlamaForCausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"no config.json in {path}")
    with open(cfg_path, encoding="utf-8") as f:
        hf = json.load(f)
    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is not llama")
    cfg = config_from_hf(hf)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    # Rotary tables are computed, never loaded (some exports still carry inv_freq).
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return model


def save_checkpoint(model: LlamaForCausalLM, path: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` in HF layout (tests and tooling)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(model.config), f, indent=2)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"))
