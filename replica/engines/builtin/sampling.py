"""Next-token choice: penalties, greedy, temperature, top-p, per-sample seeded generators,
and the logprobs reported for the chosen token.

Each sample owns its ``torch.Generator`` (seeded from the request's seed and the sample
index), so a seeded request draws the same tokens whatever else shares its batch and
whether or not its prefix came from the cache.
"""

from __future__ import annotations

import torch

from unicache.replica.engines.api import SamplingParams, TokenLogprob



def make_generator(params: SamplingParams, index: int, fallback_seed: int) -> torch.Generator | None:
    """A CPU generator for sample ``index`` (None for greedy, which draws nothing).

    Sampling runs on CPU logits whatever the model's device, so draws are identical on
    CPU and CUDA replicas.
    """
    if params.temperature == 0.0:
        return None
    seed = params.seed if params.seed is not None else fallback_seed
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index) % (2**63))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick a token from one row of float logits ``[vocab]``."""
    if params.temperature == 0.0 or generator is None:
        return int(torch.argmax(logits).item())
    # NOTE: shift before dividing: logits / a tiny temperature (1e-40 is a valid float32)
    # overflow to inf and softmax turns them into NaN, which failed the whole engine step.
    # Shifted, the top logit is exactly 0, so the result tends to greedy as T -> 0.
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def apply_penalties(logits: torch.Tensor, counts: dict[int, int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence/frequency penalties on one row of logits (a new tensor; ``logits``
    is shared by the samples of one request and stays unchanged).

    ``counts``: how often each token id was generated so far by this sample.
    """
    if not counts:
        return logits
    ids = torch.tensor(list(counts), dtype=torch.long)
    c = torch.tensor(list(counts.values()), dtype=logits.dtype)
    out = logits.clone()
    out[ids] -= c * params.frequency_penalty + params.presence_penalty
    return out


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """``token_id``'s log-probability under the raw ``logits`` and the ``k`` most likely
    tokens (ties: lower id first, as ``torch.topk`` on CPU returns them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(float(logp[token_id].item()), top)
