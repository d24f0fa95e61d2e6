"""The model's paged path against a plain causal forward; checkpoint round trip; K/V storage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unicache.replica.engines.builtin.attention import build_metadata
from unicache.replica.engines.builtin.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.model import LlamaForCausalLM, ModelConfig
from unicache.replica.kv.torch_storage import TorchKVStorage
from tests.support.engine_factory import TINY_MODEL, make_request, run_one, tiny_config

BS = 4


def _model(seed: int = 3, **kw) -> LlamaForCausalLM:
    return LlamaForCausalLM.random(ModelConfig(**{**TINY_MODEL, **kw}), seed)


def _storage(model: LlamaForCausalLM, num_blocks: int = 32) -> TorchKVStorage:
    c = model.config
    return TorchKVStorage(c.num_layers, num_blocks, BS, c.num_kv_heads, c.dim_per_head)


def _paged_logits(model, storage, chunks):
    """chunks: (tokens, table, start, end); returns logits of every computed row."""
    ids, pos = [], []
    for toks, _, start, end in chunks:
        ids += toks[start:end]
        pos += list(range(start, end))
    meta = build_metadata([(t, s, e) for _, t, s, e in chunks], BS, torch.device("cpu"))
    hidden = model(torch.tensor(ids), torch.tensor(pos), storage, meta)
    return model.logits(hidden)


def test_prefill_of_uncached_suffix_matches_full_forward():
    model = _model()
    storage = _storage(model)
    toks = [(i * 37) % 259 for i in range(30)]
    table = [9, 2, 17, 5, 30, 11, 0, 4]  # scattered blocks: the gather must follow the table
    dense = model.forward_dense(torch.tensor(toks))
    first = _paged_logits(model, storage, [(toks, table, 0, 21)])
    suffix = _paged_logits(model, storage, [(toks, table, 21, 30)])
    torch.testing.assert_close(first, dense[:21], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(suffix, dense[21:], atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_prefill_chunks_and_decode_tokens_matches_full_forwards():
    model = _model()
    storage = _storage(model)
    a = [(i * 11 + 3) % 259 for i in range(13)]
    b = [(i * 5 + 1) % 259 for i in range(9)]
    c = [(i * 7 + 2) % 259 for i in range(6)]
    ta, tb, tc = [1, 7, 3, 12], [20, 21, 6], [8, 9]
    _paged_logits(model, storage, [(a, ta, 0, 12), (b, tb, 0, 8)])
    # One step: decode a (pos 12), decode b (pos 8), prefill all of c.
    mixed = _paged_logits(model, storage, [(a, ta, 12, 13), (b, tb, 8, 9), (c, tc, 0, 6)])
    torch.testing.assert_close(mixed[0], model.forward_dense(torch.tensor(a))[12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], model.forward_dense(torch.tensor(b))[8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[2:], model.forward_dense(torch.tensor(c)), atol=1e-4, rtol=1e-4)


def test_copy_block_copies_every_layer_of_k_and_v():
    s = TorchKVStorage(num_layers=2, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2)
    s.k[:, 1] = torch.arange(8.0).view(2, 2, 1, 2)
    s.v[:, 1] = -torch.arange(8.0).view(2, 2, 1, 2)
    s.copy_block(1, 2)
    assert torch.equal(s.k[:, 2], s.k[:, 1]) and torch.equal(s.v[:, 2], s.v[:, 1])
    assert torch.count_nonzero(s.k[:, 0]) == 0
    k0, _ = s.layer_views(1)
    assert k0.shape == (6, 1, 2) and torch.equal(k0[4:6], s.k[1, 2])


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip_gives_the_same_logits(tmp_path, tied):
    model = _model(seed=11, tie_word_embeddings=tied)
    save_checkpoint(model, str(tmp_path))
    loaded = load_checkpoint(str(tmp_path))
    want = dataclasses.replace(model.config, head_dim=model.config.dim_per_head)
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(want)
    toks = torch.tensor([5, 100, 42, 7, 258, 0, 19])
    torch.testing.assert_close(loaded.forward_dense(toks), model.forward_dense(toks), atol=0, rtol=0)


def test_engine_serves_a_checkpoint_like_the_in_memory_model(tmp_path):
    cfg = tiny_config()
    save_checkpoint(LlamaForCausalLM.random(cfg.model, cfg.seed), str(tmp_path))
    want = run_one(LLMEngine(cfg), make_request("a", [3, 1, 4, 1, 5, 9, 2, 6], max_tokens=6))
    got = run_one(LLMEngine(tiny_config(checkpoint=str(tmp_path))), make_request("a", [3, 1, 4, 1, 5, 9, 2, 6], max_tokens=6))
    assert got.tokens == want.tokens


def test_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    save_checkpoint(_model(), str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(str(tmp_path))


def test_generation_config_eos_ids_end_a_sample_like_the_tokenizers_eos(tmp_path):
    # The byte tokenizer's EOS is 257; a checkpoint's generation_config.json may name more
    # end ids (Llama-3-Instruct: <|eot_id|>). vLLM stops on each, and returns no text for
    # the stopping token; ignore_eos ignores them all.
    import json

    cfg = tiny_config(checkpoint=str(tmp_path))
    save_checkpoint(LlamaForCausalLM.random(tiny_config().model, 7), str(tmp_path))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = run_one(LLMEngine(cfg), make_request("a", prompt, max_tokens=6))
    t = free.tokens[0]
    first_new = next(i for i, tok in enumerate(t) if tok not in t[:i] and tok != 257)  # a token not seen before it
    assert first_new < 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [250, t[first_new]]}))
    eng = LLMEngine(cfg)
    assert eng.eos_token_ids == frozenset({257, 250, t[first_new]})
    stopped = run_one(eng, make_request("a", prompt, max_tokens=6, ignore_eos=False))
    assert stopped.tokens[0] == t[: first_new + 1]
    assert stopped.last[0].finish_reason == "stop"
    assert stopped.text[0] == eng.tokenizer.decode(t[:first_new])  # the stopping token's text is not returned
    assert run_one(LLMEngine(cfg), make_request("a", prompt, max_tokens=6)).tokens == free.tokens  # ignore_eos
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="eos_token_id must be a token id"):
        LLMEngine(cfg)
