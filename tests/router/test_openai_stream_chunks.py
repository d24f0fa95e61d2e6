"""``StreamChunks`` (the SSE events from templates) against the chunk objects they stand
for, serialised as the front door used to: ``json.dumps(chunk, separators=(",", ":"))``."""

from __future__ import annotations

import json

import pytest

from unicache.router.frontends.openai_response import StreamChunks, base

TEXTS = ["", "a", 'quote " and \\ backslash', "line\nbreak\ttab", "héllo wörld", "日本語", "emoji 🎉", "\ud800 lone", "\x00\x1f"]


def reference(rid, created, model, chat, include_usage, index, text, reason, lp, first) -> bytes:
    chunk = base(rid, created, model, chat, chunk=True)
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": lp}
    chunk["choices"] = [choice]
    if include_usage:
        chunk["usage"] = None
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("reason", [None, "length", "stop", "abort"])
def test_choice_events_are_the_chunk_objects_bytes(chat, include_usage, first, reason):
    rid, created, model = "cmpl-0123abcd", 1764600000, 'model "x" é'
    events = StreamChunks(rid, created, model, chat, include_usage)
    for i, text in enumerate(TEXTS):
        got = events.choice(i, text, reason, None, first)
        assert got == reference(rid, created, model, chat, include_usage, i, text, reason, None, first)
        assert json.loads(got[len(b"data: "):])["choices"][0]["index"] == i


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_are_encoded_as_before(chat):
    lp = (
        {"content": [{"token": "é", "logprob": -0.25, "bytes": [195, 169], "top_logprobs": [{"token": "a", "logprob": -1e-05, "bytes": [97]}]}]}
        if chat
        else {"tokens": ["a", "\n"], "token_logprobs": [-0.5, -3.0e-7], "top_logprobs": [{"a": -0.5}, {"\n": -1.0}], "text_offset": [0, 1]}
    )
    events = StreamChunks("chatcmpl-1", 7, "m", chat, True)
    assert events.choice(3, "a\n", "stop", lp, True) == reference("chatcmpl-1", 7, "m", chat, True, 3, "a\n", "stop", lp, True)


@pytest.mark.parametrize("chat", [False, True])
def test_usage_event(chat):
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}
    chunk = base("r", 9, "m", chat, chunk=True)
    chunk["choices"] = []
    chunk["usage"] = usage
    want = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    assert StreamChunks("r", 9, "m", chat, True).usage(usage) == want
