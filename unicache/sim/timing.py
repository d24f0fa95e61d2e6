"""How long simulated work takes: the prefill-time model and the per-token decode time."""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    prefill_coef: float = 5.56e-5
    batch_exp: float = 0.992
    token_exp: float = 1.034
    decode_s_per_token: float = 0.02

    def __post_init__(self) -> None:
        if self.prefill_coef < 0 or self.decode_s_per_token < 0:
            raise ValueError("timing coefficients must be non-negative")

    def prefill_s(self, batch: int, uncached_tokens: int) -> float:
        """Time to prefill ``batch`` requests computing ``uncached_tokens`` tokens in all."""
        if batch <= 0:
            return 0.0
        per_request = max(uncached_tokens / batch, 1.0)
        return self.prefill_coef * batch**self.batch_exp * per_request**self.token_exp

    def decode_s(self, output_tokens: int) -> float:
        return self.decode_s_per_token * output_tokens
