"""Building OpenAI response objects from replica messages (pure functions, no I/O).

Choice index = prompt index * n + sample index (OpenAI's order for batch prompts).
Logprobs come from the replica (``GenerateResponse.logprobs``, one per token id); the
token strings are the router tokenizer's decoding of each id alone.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_str  # what json.dumps does to a str
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


class StreamChunks:
    """The server-sent events of one streamed response, from text templates made once.

    Each event is byte for byte ``b"data: " + json.dumps(chunk, separators=(",", ":"))
    + b"\\n\\n"`` of the chunk object ``base(...)`` plus ``choices`` (and ``usage``) would
    make (tests/router/test_openai_stream_chunks.py compares them), without building the dicts
    and walking them per token: only the text, the finish reason and the logprobs are
    encoded per event.
    """

    __slots__ = ("_head", "_tail", "_chat")

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = f'data: {{"id":{_json_str(rid)},"object":"{obj}","created":{int(created)},"model":{_json_str(model)},"choices":['
        self._tail = ']' + (',"usage":null' if include_usage else "") + "}\n\n"
        self._chat = chat

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None, first: bool = False) -> bytes:
        """The event of one choice's delta; ``first``: the choice's first chat delta (it
        carries the assistant role); ``logprobs``: the choice's logprobs object or None."""
        reason = "null" if finish_reason is None else _json_str(finish_reason)
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"))
        if self._chat:
            role = '"role":"assistant",' if first else ""
            body = f'{{"index":{index},"delta":{{{role}"content":{_json_str(text)}}},"logprobs":{lp},"finish_reason":{reason}}}'
        else:
            body = f'{{"index":{index},"text":{_json_str(text)},"finish_reason":{reason},"logprobs":{lp}}}'
        return (self._head + body + self._tail).encode()

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The last event of ``stream_options.include_usage``: no choices, the usage."""
        return (self._head + '],"usage":' + json.dumps(usage, separators=(",", ":")) + "}\n\n").encode()
