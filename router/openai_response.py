"""Building OpenAI response objects from replica messages (pure functions, no I/O).

Choice index = prompt index * n + sample index (OpenAI's order for batch prompts).
Logprobs come from the replica (``GenerateResponse.logprobs``, one per token id); the
token strings are the router tokenizer's decoding of each id alone.
"""

from __future__ import annotations

from typing import Any

from unicache.v1 import common_pb2, replica_pb2

FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def base(rid: str, created: int, model: str, chat: bool, chunk: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


class TokenText:
    """Token id -> its text alone (cached: logprobs name the same tokens again and again)."""

    def __init__(self, tokenizer, max_entries: int = 65536):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < self.max_entries:
                self._cache[token_id] = text
        return text


def chat_logprobs(msg: replica_pb2.GenerateResponse, text: TokenText) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries for the tokens of one replica message."""
    out = []
    for tid, lp in zip(msg.token_ids, msg.logprobs):
        tok = text(tid)
        out.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := text(alt.token_id)), "logprob": alt.logprob, "bytes": list(t.encode("utf-8"))} for alt in lp.top
                ],
            }
        )
    return out


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object of one choice, grown message by message."""

    def __init__(self, offset: int = 0):
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, msg: replica_pb2.GenerateResponse, text: TokenText) -> None:
        for tid, lp in zip(msg.token_ids, msg.logprobs):
            tok = text(tid)
            self.tokens.append(tok)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append({text(alt.token_id): alt.logprob for alt in lp.top})
            self.text_offset.append(self.offset)
            self.offset += len(tok)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class UsageTally:
    """Usage over a (batch) request: prompt tokens counted once per prompt, completion
    tokens summed over every choice (counted from token ids where a replica sent no usage)."""

    def __init__(self, num_prompts: int):
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion: dict[int, int] = {}
        self.counted: dict[int, int] = {}

    def add(self, prompt_index: int, choice: int, msg: replica_pb2.GenerateResponse) -> None:
        self.counted[choice] = self.counted.get(choice, 0) + len(msg.token_ids)
        if msg.HasField("usage"):
            u = msg.usage
            self.prompt[prompt_index] = max(self.prompt[prompt_index], u.prompt_tokens)
            self.cached[prompt_index] = max(self.cached[prompt_index], u.cached_tokens)
            self.completion[choice] = u.completion_tokens

    def set_prompt(self, prompt_index: int, tokens: int) -> None:
        self.prompt[prompt_index] = tokens

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt)
        completion = sum(self.completion.get(c, n) for c, n in self.counted.items())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached)},
        }
