"""Load (and, for tests and tools, save) a Llama-family checkpoint from a local directory.

Format: Hugging Face's ``config.json`` (read by ``hf_config.config_from_hf``, which refuses
what the engine cannot reproduce) plus one or more ``*.safetensors`` files with HF
parameter names (``model.layers.0.self_attn.q_proj.weight`` ...). Our modules use the same
names, so loading is ``load_state_dict`` after reading the tensors. Nothing is downloaded.

Invariant: every parameter of the model comes from the files (no tensor left at its
initial value, none ignored); with tied embeddings the head is the embedding matrix, and
a checkpoint whose separate ``lm_head.weight`` differs from it is refused.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file, save_file

from unicache.replica.engines.builtin.hf_config import CheckpointError, config_from_hf, config_to_hf
from unicache.replica.engines.builtin.model import LlamaForCausalLM

__all__ = ["CheckpointError", "generation_eos_ids", "load_checkpoint", "save_checkpoint"]


def generation_eos_ids(path: str) -> frozenset[int]:
    """The end-of-sequence ids the checkpoint's generation config names, as vLLM reads them:
    ``generation_config.json``'s ``eos_token_id`` (an int or a list; Llama-3-Instruct lists
    ``<|eot_id|>`` beside ``<|end_of_text|>``), else ``config.json``'s; empty when neither
    names one. A file that is not valid JSON is a CheckpointError."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        with open(file, encoding="utf-8") as f:
            try:
                eos = json.load(f).get("eos_token_id")
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{name} is not valid JSON (line {exc.lineno})") from None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"{name}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return frozenset(ids)
    return frozenset()


def load_checkpoint(path: str) -> LlamaForCausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"no config.json in {path}")
    with open(cfg_path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"config.json is not valid JSON (line {exc.lineno})") from None
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
        head, embed = state.pop("lm_head.weight", None), state.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise CheckpointError("config.json tie_word_embeddings is true but lm_head.weight differs from the embeddings")
        if embed is not None:
            state["lm_head.weight"] = embed
    model = LlamaForCausalLM(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches: config.json and the tensors disagree
        first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise CheckpointError(f"checkpoint does not match config.json: {first}") from None
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
