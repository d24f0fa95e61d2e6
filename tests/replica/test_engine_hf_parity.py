"""The built-in engine against transformers on checkpoints transformers itself wrote.

Every case of ``unicache.testing.hf_models.CASES`` (rope default/linear/dynamic/llama3/yarn in
both config layouts, Qwen2, Mistral, tied embeddings, explicit head_dim, biases): the
dense forward, the paged path (prefill, cached suffix, decode) and the engine's greedy
tokens equal transformers'. Configs the engine cannot reproduce fail at load, naming the key.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from unicache.replica.engines.builtin.checkpoint import CheckpointError, load_checkpoint
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.model import Rotary
from tests.support.engine_factory import make_request, run_one, tiny_config
from unicache.testing.hf_models import (
    CASES, REFUSED, edit_config, hf_greedy, hf_logits, load_hf, paged_logits, prompt, write_case,
)

BS = 4
PROMPT = prompt(40)
NEW_TOKENS = 12

EXPECTED = {  # what config_from_hf must read: (architecture, rope_type, qkv_bias, o_bias, mlp_bias, tied, head_dim)
    "llama-default": ("llama", "default", False, False, False, False, 16),
    "llama-linear": ("llama", "linear", False, False, False, False, 16),
    "llama-dynamic": ("llama", "dynamic", False, False, False, False, 16),
    "llama-llama3": ("llama", "llama3", False, False, False, False, 16),
    "llama-llama3-rope_scaling": ("llama", "llama3", False, False, False, False, 16),
    "llama-yarn": ("llama", "yarn", False, False, False, False, 16),
    "llama-yarn-mscale": ("llama", "yarn", False, False, False, False, 16),
    "llama-tied": ("llama", "default", False, False, False, True, 16),
    "llama-head_dim": ("llama", "default", False, False, False, False, 32),
    "llama-bias": ("llama", "default", True, True, True, False, 16),
    "qwen2": ("qwen2", "default", True, False, False, False, 16),
    "qwen2-tied": ("qwen2", "default", True, False, False, True, 16),
    "mistral": ("mistral", "default", False, False, False, False, 32),
    "mistral-window-4096": ("mistral", "default", False, False, False, False, 16),
    "mistral-window-8": ("mistral", "default", False, False, False, False, 16),
    "qwen2-window-layer1": ("qwen2", "default", True, False, False, False, 16),
}
WINDOWS = {"mistral-window-4096": (4096, None), "mistral-window-8": (8, None), "qwen2-window-layer1": (8, (1,))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every case written once per module: name -> directory."""
    root = tmp_path_factory.mktemp("hf")
    return {name: write_case(name, str(root / name)) for name in CASES}


def test_cases_are_all_checked():
    assert set(EXPECTED) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_is_read_as_transformers_reads_it(checkpoints, name):
    cfg = load_checkpoint(checkpoints[name]).config
    got = (cfg.architecture, cfg.rope.rope_type, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.tie_word_embeddings, cfg.dim_per_head)
    assert got == EXPECTED[name]
    assert (cfg.sliding_window, cfg.sliding_layers) == WINDOWS.get(name, (None, None))
    hf = load_hf(checkpoints[name]).config
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.max_position == hf.max_position_embeddings
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_equal_transformers(checkpoints, name):
    path = checkpoints[name]
    hf = load_hf(path)
    ours = load_checkpoint(path)
    want_tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    full = PROMPT + want_tokens
    want = hf_logits(hf, full)
    torch.testing.assert_close(ours.forward_dense(torch.tensor(full)), want, atol=1e-5, rtol=0)
    # Paged: prefill 0..29, the cached prefix's suffix 30..39, then decode one by one.
    chunks = [(full, 0, 30), (full, 30, 40)] + [(full, p, p + 1) for p in range(40, len(full))]
    torch.testing.assert_close(paged_logits(ours, chunks, BS), want, atol=1e-4, rtol=0)
    engine = LLMEngine(tiny_config(checkpoint=path, block_size=BS))
    got = run_one(engine, make_request("a", PROMPT, max_tokens=NEW_TOKENS))
    assert got.tokens[0] == want_tokens


@pytest.mark.parametrize("name", ["llama-linear", "llama-llama3", "llama-yarn", "llama-yarn-mscale"])
def test_each_rope_type_changes_the_logits(checkpoints, name):
    """The parity above would be vacuous if a rope type computed what default rope does."""
    model = load_checkpoint(checkpoints[name])
    ids = torch.tensor(PROMPT)
    scaled = model.forward_dense(ids)
    model.config.rope = dataclasses.replace(model.config.rope, rope_type="default")
    model.rotary = Rotary(model.config)
    assert float((scaled - model.forward_dense(ids)).abs().max()) > 1.0


def test_rope_scaling_layout_reads_like_rope_parameters(checkpoints):
    a = load_checkpoint(checkpoints["llama-llama3"])
    b = load_checkpoint(checkpoints["llama-llama3-rope_scaling"])
    assert a.config.rope == b.config.rope
    ids = torch.tensor(PROMPT)
    assert torch.equal(a.forward_dense(ids), b.forward_dense(ids))


def test_top_level_original_max_position_wins_as_in_transformers(tmp_path):
    path = write_case("llama-llama3", str(tmp_path))
    edit_config(path, lambda c: c.update(original_max_position_embeddings=16))
    assert load_checkpoint(path).config.rope.original_max_position == 16
    assert load_hf(path).config.rope_parameters["original_max_position_embeddings"] == 16
    torch.testing.assert_close(load_checkpoint(path).forward_dense(torch.tensor(PROMPT)), hf_logits(load_hf(path), PROMPT), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mistral-window-8", "qwen2-window-layer1"])
def test_the_sliding_window_changes_the_logits(checkpoints, name):
    """A window shorter than the context must bind (else the parity above would not test it)."""
    model = load_checkpoint(checkpoints[name])
    ids = torch.tensor(PROMPT)
    windowed = model.forward_dense(ids)
    model.config.sliding_window = None
    assert float((windowed - model.forward_dense(ids)).abs().max()) > 1.0
    # The first 8 positions see the same keys either way.
    torch.testing.assert_close(windowed[:8], model.forward_dense(ids)[:8], atol=0, rtol=0)


def test_qwen2_without_sliding_layers_has_no_window(tmp_path):
    path = write_case("qwen2", str(tmp_path), use_sliding_window=True, sliding_window=8, max_window_layers=2)
    cfg = load_checkpoint(path).config
    assert (cfg.sliding_window, cfg.sliding_layers) == (None, None)


def test_a_model_with_a_window_refuses_metadata_without_it(checkpoints):
    from unicache.replica.engines.builtin.attention import build_metadata
    from unicache.replica.kv.torch_storage import TorchKVStorage

    model = load_checkpoint(checkpoints["mistral-window-8"])
    c = model.config
    storage = TorchKVStorage(c.num_layers, 4, BS, c.num_kv_heads, c.dim_per_head)
    meta = build_metadata([([0, 1], 0, 5)], BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="8-token window"):
        model(torch.tensor(PROMPT[:5]), torch.arange(5), storage, meta)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unsupported_config_fails_at_load_naming_the_key(checkpoints, tmp_path, key):
    edit, message = REFUSED[key]
    path = shutil.copytree(checkpoints["llama-default"], str(tmp_path / "ckpt"))
    edit_config(path, edit)
    with pytest.raises(CheckpointError) as info:
        LLMEngine(tiny_config(checkpoint=path, block_size=BS))
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text


def test_tied_config_with_a_different_lm_head_is_refused(checkpoints, tmp_path):
    path = shutil.copytree(checkpoints["llama-default"], str(tmp_path / "ckpt"))
    state = load_file(f"{path}/model.safetensors")
    assert "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    edit_config(path, lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(CheckpointError, match="^config.json tie_word_embeddings is true but lm_head.weight differs"):
        load_checkpoint(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, f"{path}/model.safetensors")
    assert load_checkpoint(path).config.tie_word_embeddings
