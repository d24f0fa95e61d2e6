"""How long simulated work takes: the prefill-time model, the per-token decode time and the
host-to-device copy of promoted KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

# KV bytes per token by model: layers * kv_heads * head_dim * 2 (K and V) * 2 bytes (bf16).
KV_BYTES_PER_TOKEN: dict[str, int] = {
    "llama-3-8b": 32 * 8 * 128 * 2 * 2,  # 128 KiB
    "llama-3-70b": 80 * 8 * 128 * 2 * 2,  # 320 KiB
    "qwen2.5-7b": 28 * 4 * 128 * 2 * 2,  # 56 KiB
}
DEFAULT_MODEL_PRESET = "llama-3-8b"
DEFAULT_H2D_BYTES_PER_S = 25e9  # PCIe 4.0 x16 as measured, roughly


def kv_bytes_per_token(preset: str) -> int:
    """The preset's KV bytes per token (ValueError naming the presets if unknown)."""
    try:
        return KV_BYTES_PER_TOKEN[preset]
    except KeyError:
        raise ValueError(f"unknown model preset {preset!r} (choose from {', '.join(KV_BYTES_PER_TOKEN)})") from None


@dataclass(slots=True, frozen=True)
class TimingModel:
    """Prefill time of a batch and decode time of a request, in seconds.

    The default prefill model is the UniCache paper's fit:
    ``coef * batch**batch_exp * uncached_tokens**token_exp`` where ``uncached_tokens`` is
    the mean uncached prompt length of the batch (at least one token is always computed:
    a full hit still runs the last position to produce logits).

    Args:
        prefill_coef: seconds scale of the fit (default 5.56e-5).
        batch_exp: exponent of the batch size (default 0.992).
        token_exp: exponent of the uncached tokens (default 1.034).
        decode_s_per_token: constant time per output token (default 0.02 s).
        h2d_bytes_per_s: host-to-device bandwidth a promotion's copy runs at (default
            25 GB/s).
        kv_bytes_per_token: KV bytes one token's blocks hold (default the Llama-3-8B-like
            preset, 128 KiB; ``KV_BYTES_PER_TOKEN``).

    A calibration (``from_costs``: a backend's costs as the router fitted them live,
    ``unicache.router.routing.cost_model``) replaces the fit with a line: a batch's prefill
    takes ``prefill_base_s + prefill_per_token_s * uncached_tokens`` whenever
    ``prefill_per_token_s`` > 0.

    Promoting host-tier blocks costs ``promote_s`` = blocks * block_size *
    kv_bytes_per_token / h2d_bytes_per_s, added to that request's time to first token
    (its copy must land before its prefill reads the blocks). Demotion costs nothing
    here: its device-to-host copy overlaps compute.
    """

    prefill_coef: float = 5.56e-5
    batch_exp: float = 0.992
    token_exp: float = 1.034
    decode_s_per_token: float = 0.02
    h2d_bytes_per_s: float = DEFAULT_H2D_BYTES_PER_S
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN[DEFAULT_MODEL_PRESET]
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0

    @classmethod
    def from_costs(cls, costs, batch: int = 4, **kwargs) -> "TimingModel":
        """The timing of a backend with ``costs`` (a ``Costs``): its prefill line, and its
        inter-token time at a decode batch of ``batch`` requests as every output token's."""
        return cls(decode_s_per_token=costs.decode_base_s + costs.decode_per_seq_s * batch,
                   prefill_base_s=costs.prefill_base_s, prefill_per_token_s=costs.prefill_per_token_s, **kwargs)

    def __post_init__(self) -> None:
        if self.prefill_coef < 0 or self.decode_s_per_token < 0 or self.prefill_base_s < 0 or self.prefill_per_token_s < 0:
            raise ValueError("timing coefficients must be non-negative")
        if not self.h2d_bytes_per_s > 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("host-to-device bandwidth and KV bytes per token must be positive")

    def promote_s(self, blocks: int, block_size: int) -> float:
        """Time to copy ``blocks`` host-tier blocks of ``block_size`` tokens to the GPU."""
        return blocks * block_size * self.kv_bytes_per_token / self.h2d_bytes_per_s

    def prefill_s(self, batch: int, uncached_tokens: int) -> float:
        """Time to prefill ``batch`` requests computing ``uncached_tokens`` tokens in all."""
        if batch <= 0:
            return 0.0
        if self.prefill_per_token_s > 0:
            return self.prefill_base_s + self.prefill_per_token_s * max(uncached_tokens, batch)
        per_request = max(uncached_tokens / batch, 1.0)
        return self.prefill_coef * batch**self.batch_exp * per_request**self.token_exp

    def decode_s(self, output_tokens: int) -> float:
        return self.decode_s_per_token * output_tokens
