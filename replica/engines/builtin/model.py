"""A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` so a Llama-format
safetensors checkpoint loads with ``load_state_dict`` (see checkpoint.py). The same module
serves the Llama family members that differ only in config (``hf_config.py``): Qwen2
(q/k/v bias), Mistral, tied embeddings, explicit ``head_dim``, every rope type of ``rope.py``.

Two forward paths share the weights:
    * ``forward(ids, positions, kv, meta)``: the serving path, K/V paged in ``TorchKVStorage``;
    * ``forward_dense(ids)``: a plain causal forward with no cache (the reference the tests
      compare the paged path against).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from unicache.replica.engines.builtin.attention import AttentionMetadata, paged_attention
from unicache.replica.engines.builtin.model_config import ModelConfig  # noqa: F401 - part of this module's API
from unicache.replica.engines.builtin.rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary embedding with HF's rotate-half layout; cos/sin precomputed for max_position.

    The tables are float32 (as transformers computes them, see rope.py) and are cast to
    the activations' dtype per forward, as transformers does.
    """

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        cos, sin = rope_tables(cfg.rope, cfg.dim_per_head, cfg.max_position, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``, shaped ``[T, 1, head_dim]`` (once per forward)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: ``[T, heads, head_dim]``."""
        cos, sin = cos_sin
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.dim_per_head
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def _qkv(self, x: torch.Tensor, cos_sin):
        t = x.shape[0]
        q = Rotary.apply(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos_sin)
        k = Rotary.apply(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos_sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x, cos_sin, k_cache, v_cache, meta: AttentionMetadata):
        q, k, v = self._qkv(x, cos_sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.num_heads // self.num_kv_heads)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_dense(self, x, cos_sin, window: int | None = None):
        q, k, v = self._qkv(x, cos_sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        gqa = self.num_heads != self.num_kv_heads
        if window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            pos = torch.arange(x.shape[0], device=x.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out[0].transpose(0, 1)
        return self.o_proj(out.reshape(x.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. ``forward`` returns final hidden states; ``logits`` projects rows."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int) -> "LlamaForCausalLM":
        """A model with seeded random weights (same seed, same weights, on any machine)."""
        model = cls(cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * cfg.init_std)
        return model

    def place(self, device: torch.device, dtype: torch.dtype) -> "LlamaForCausalLM":
        """Move weights to ``device``/``dtype``; rotary tables stay float32 (as transformers keeps them)."""
        self.to(device=device, dtype=dtype).eval()
        self.rotary = Rotary(self.config, device)
        return self

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states. ``meta`` must come from ``build_metadata(...,
        sliding_window=config.sliding_window)``: its sliding layers read ``meta.windowed``."""
        cfg = self.config
        if cfg.sliding_window is not None and (meta.windowed is None or meta.windowed.window != cfg.sliding_window):
            raise ValueError(f"this model attends through a {cfg.sliding_window}-token window: build_metadata(sliding_window=...)")
        h = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.tables(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv.layer_views(i)
            layer_meta = meta.windowed if cfg.layer_window(i) is not None else meta
            h = h + layer.self_attn(layer.input_layernorm(h), cos_sin, k_cache, v_cache, layer_meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of a plain causal forward over ``input_ids`` (no KV cache)."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.tables(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos_sin, self.config.layer_window(i))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.logits(self.model.norm(h))
