"""Translate vLLM's per-token logprobs into the replica's ``TokenLogprob``.

vLLM (``SamplingParams(logprobs=k)``, default ``logprobs_mode="raw_logprobs"``: log-softmax
of the raw logits, before penalties and temperature, as the built-in engine reports) gives
one ``{token_id: Logprob(logprob, rank)}`` dict per generated token: the k most likely
tokens (ranks 1..k) plus the sampled token, whatever its rank. Ours is the sampled token's
logprob and the top k ``(token_id, logprob)`` pairs, highest first; so the sampled token
appears in ``top`` only when its rank is at most k. Needs no vLLM import (duck-typed on
``.logprob`` / ``.rank``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from unicache.replica.engines.api import TokenLogprob


def token_logprobs(token_ids: Sequence[int], per_token: Sequence[Mapping[int, Any]] | None, k: int | None) -> list[TokenLogprob] | None:
    """One ``TokenLogprob`` per entry of ``token_ids``; None when none were asked for (k None).

    Raises ValueError when vLLM returned none, or not one dict per token, although asked:
    a silently missing logprob would reach the client as a wrong answer."""
    if k is None:
        return None
    if per_token is None or len(per_token) != len(token_ids):
        got = "none" if per_token is None else len(per_token)
        raise ValueError(f"vLLM returned logprobs for {got} of {len(token_ids)} tokens")
    out = []
    for tid, entries in zip(token_ids, per_token):
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k)
        out.append(TokenLogprob(float(entries[tid].logprob), [(t, float(v)) for _, t, v in top]))
    return out
