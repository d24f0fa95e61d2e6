"""The request checks every engine makes before anything is queued (built-in and vLLM).

``check_request`` raises ``EngineInputError`` naming the field for a request that can never
be served as given: "invalid" for a value outside its range, "exhausted" for one that does
not fit the context or the KV cache. An engine adds only what is its own (a request id
already in flight, an option it lacks). No torch import: the vLLM engine uses it too.
"""

from __future__ import annotations

from unicache.replica.engines.api import EngineInputError, EngineRequest

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit; vLLM's max_logprobs)
MAX_SALT_BYTES = 64


def check_request(req: EngineRequest, *, vocab_size: int, max_model_len: int, max_n: int, num_blocks: int, block_size: int) -> None:
    """Raise ``EngineInputError`` unless ``req`` can be served by an engine of this shape.

    ``max_tokens`` None (generate up to the context) needs room for at least one new token.
    """
    p = req.sampling
    n_prompt = len(req.prompt_token_ids)
    if n_prompt == 0:
        raise EngineInputError("invalid", "prompt is empty")
    if p.max_tokens is not None and (p.max_tokens < 1 or p.max_tokens > max_model_len):
        raise EngineInputError("invalid", f"max_tokens must be in [1, {max_model_len}], got {p.max_tokens}")
    if not p.temperature >= 0.0:
        raise EngineInputError("invalid", f"temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise EngineInputError("invalid", f"top_p must be in (0, 1], got {p.top_p}")
    if p.n < 1 or p.n > max_n:
        raise EngineInputError("invalid", f"n must be in [1, {max_n}], got {p.n}")
    if any(not s for s in p.stop):
        raise EngineInputError("invalid", "stop strings must be non-empty")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise EngineInputError("invalid", f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2.0 <= value <= 2.0:
            raise EngineInputError("invalid", f"{name} must be in [-2, 2], got {value}")
    bad_stop = next((t for t in p.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise EngineInputError("invalid", f"stop token id {bad_stop} outside the vocabulary [0, {vocab_size})")
    if req.cache_salt is not None and len(req.cache_salt) > MAX_SALT_BYTES:
        raise EngineInputError("invalid", f"cache_salt is {len(req.cache_salt)} bytes (at most {MAX_SALT_BYTES})")
    bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineInputError("invalid", f"token id {bad} outside the vocabulary [0, {vocab_size})")
    total = n_prompt + (p.max_tokens if p.max_tokens is not None else 1)
    if total > max_model_len:
        raise EngineInputError(
            "exhausted", f"prompt ({n_prompt} tokens) + max_tokens ({p.max_tokens or 1}) exceeds the context of {max_model_len}"
        )
    need = -(-total // block_size)
    if need > num_blocks:
        raise EngineInputError("exhausted", f"request needs {need} KV blocks, the cache has {num_blocks}")
