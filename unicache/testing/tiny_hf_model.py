"""A tiny random-weight Hugging Face Llama directory with its tokenizer, for vLLM runs.

``write_tiny_llama(path)`` saves config.json + model.safetensors (transformers'
``save_pretrained``) and a word-level tokenizer trained with ``tokenizers`` (tokenizer.json,
tokenizer_config.json), the files a local model directory has; ``write_tiny_lora(path, base)``
a LoRA adapter of it, as PEFT saves one. Nothing is downloaded.

The shape suits vLLM's CPU backend (head size 64) and stays small enough that an engine
step costs milliseconds. Used by tests/replica/test_vllm_engine.py and bench/vllm_engine.py (the
transformers-parity checkpoints of the built-in engine are tests/support/hf_models.py:
no tokenizer, head sizes vLLM's CPU kernels lack).
"""

from __future__ import annotations

import json
import os

WORDS = [f"w{i}" for i in range(480)]
SPECIAL = ["<unk>", "<s>", "</s>"]
VOCAB_SIZE = len(SPECIAL) + len(WORDS)


# A chat template in the tokenizer's own words: each message's content then ``</s>``; the
# generation prompt is ``<s>``.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"


def train_tokenizer(path: str, chat_template: bool = False) -> None:
    """A word-level tokenizer over ``WORDS`` (whitespace split), saved as tokenizer.json plus
    a tokenizer_config.json that names its special tokens (and ``CHAT_TEMPLATE``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1)
    tok.train_from_iterator([" ".join(WORDS)], trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                **({"chat_template": CHAT_TEMPLATE} if chat_template else {}),
            },
            f,
        )


def write_tiny_llama(path: str, seed: int = 0, max_position: int = 4096, num_layers: int = 2, chat_template: bool = False) -> str:
    """Write the model directory at ``path`` (created if missing); returns ``path``.
    ``chat_template``: its tokenizer has ``CHAT_TEMPLATE``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    train_tokenizer(path, chat_template)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_position,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # large weights: greedy tokens vary with the context
    model.save_pretrained(path, safe_serialization=True)
    return path



def write_tiny_lora(path: str, base: str, seed: int = 1, rank: int = 8, scale: float = 0.5) -> str:
    """Write a LoRA adapter of ``write_tiny_llama``'s model at ``path`` (created if missing),
    as PEFT saves one: adapter_config.json and adapter_model.safetensors with random A and
    B matrices for every layer's ``q_proj`` and ``v_proj`` (``scale``: their spread, large
    enough that the adapter changes the greedy tokens). Returns ``path``."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank, "lora_alpha": rank,
            "lora_dropout": 0.0, "target_modules": sorted(outs), "bias": "none", "fan_in_fan_out": False,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "inference_mode": True,
        }, f, indent=1)
    return path
