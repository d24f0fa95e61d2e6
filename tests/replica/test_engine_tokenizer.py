"""Tokenizers: byte-level default, Hugging Face tokenizer.json, streaming detokenization."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from unicache.contract.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "naïve café: 3€ 🍕 ok"


def stream(tok, ids):
    detok = tok.detokenizer()
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_byte_tokenizer_round_trips_and_knows_its_specials():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_token_id]) == TEXT
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (259, 256, 257)


def test_byte_stream_never_splits_a_character():
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode("€🍕"))
    # 3 bytes then 4 bytes: text appears only on each character's last byte.
    assert deltas == ["", "", "€", "", "", "", "🍕", ""]
    assert "".join(stream(tok, tok.encode(TEXT))) == TEXT


def test_byte_stream_replaces_invalid_bytes_and_flushes_a_truncated_character():
    tok = ByteTokenizer()
    assert "".join(stream(tok, [0xFF, 0x41])) == "\ufffdA"
    assert stream(tok, [0xE2, 0x82]) == ["", "", "\ufffd"]


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here on a few lines (no download)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world", "the café is naïve", "pizza 🍕 costs 3€"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trips_and_streams_whole_characters(hf_path):
    tok = load_tokenizer(str(hf_path.parent))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    deltas = stream(tok, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_missing_tokenizer_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_module_does_not_import_torch():
    code = "import sys, unicache.contract.tokenizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_uses_a_checkpoints_tokenizer_json(hf_path, tmp_path):
    import shutil

    from unicache.replica.engines.builtin.checkpoint import save_checkpoint
    from unicache.replica.engines.builtin.engine import LLMEngine
    from unicache.replica.engines.builtin.model import LlamaForCausalLM, ModelConfig
    from tests.support.engine_factory import TINY_MODEL, make_request, run_one, tiny_config

    tok = HFTokenizer(str(hf_path))
    cfg = ModelConfig(**{**TINY_MODEL, "vocab_size": tok.vocab_size})
    save_checkpoint(LlamaForCausalLM.random(cfg, 5), str(tmp_path))
    shutil.copy(hf_path, tmp_path / "tokenizer.json")
    engine = LLMEngine(tiny_config(checkpoint=str(tmp_path)))
    assert isinstance(engine.tokenizer, HFTokenizer)
    res = run_one(engine, make_request("a", tok.encode("the café"), max_tokens=12))
    assert res.text[0] == tok.decode(res.tokens[0])


def test_hf_stream_holds_back_characters_split_across_byte_tokens(hf_path):
    tok = HFTokenizer(str(hf_path))
    ids = tok.encode("жй")  # unseen in training: one byte-level token per UTF-8 byte
    assert len(ids) == 4
    assert stream(tok, ids) == ["", "ж", "", "й", ""]
