"""``unicache bench``: the prompt synthesis, the statistics, and a replay through the CLI
against an in-process router and replica (``LoadStack``)."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest

from unicache.bench_client.client import BenchConfig, run_bench, synthetic_requests
from unicache.bench_client.prompts import block_text, prompt_text
from unicache.bench_client.stats import RequestRecord, format_table, summarize
from unicache.cli.main import main
from unicache.plumbing.errors import UsageError
from unicache.sim.trace import read_trace, write_trace


def test_block_text_is_fixed_words_per_id():
    assert block_text(0, 3) == " at the word"
    assert block_text(1, 3) == " so if him"
    assert block_text(0, 3, 2) == " at the"
    assert prompt_text([0, 1], 5, 3) == " at the word so if"


def test_equal_ids_give_equal_text_and_a_new_id_new_text():
    a = prompt_text([7, 8, 9], 48, 16)
    b = prompt_text([7, 8, 10], 48, 16)
    shared = block_text(7, 16) + block_text(8, 16)
    assert a.startswith(shared) and b.startswith(shared)
    assert a[len(shared):] == block_text(9, 16) != b[len(shared):] == block_text(10, 16)
    assert prompt_text([7, 8, 9], 48, 16) == a  # deterministic
    assert len(a.split()) == 48


def test_last_block_gets_the_remaining_words_clamped():
    assert len(prompt_text([1, 2], 17, 16).split()) == 17
    assert len(prompt_text([1, 2], 999, 16).split()) == 32
    assert len(prompt_text([1, 2], 3, 16).split()) == 17


def _rec(i: int, ttft: float, *, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=i, sent_s=float(i), end_s=float(i) + 2 * ttft, ttft_s=ttft,
                      itl_s=[ttft / 2], prompt_tokens=10, completion_tokens=3, cached_tokens=i)
    r.error = error
    return r


def test_summary_exact_percentiles_goodput_and_failures():
    records = [_rec(i, (i + 1) / 10) for i in range(10)] + [_rec(10, math.nan, error="http 503")]
    records[-1].end_s = 10.0
    s = summarize(records, slo_ttft_s=0.3)
    assert (s["requests"], s["succeeded"], s["failed"], s["errors"]) == (11, 10, 1, {"http 503": 1})
    assert s["ttft_s"] == {"mean": pytest.approx(0.55), "p50": 0.5, "p90": 0.9, "p99": 1.0}
    assert s["itl_s"]["p50"] == 0.25 and s["itl_s"]["p99"] == 0.5
    assert s["e2e_s"]["p90"] == pytest.approx(1.8)
    # duration: first sent (0.0) -> last end (9 + 2.0 = 11.0)
    assert s["duration_s"] == 11.0
    assert s["throughput_rps"] == 10 / 11.0 and s["output_tps"] == 30 / 11.0
    assert s["good_requests"] == 3 and s["goodput_rps"] == 3 / 11.0
    assert (s["cached_reported"], s["cached_tokens"], s["prompt_tokens"]) == (10, 45, 100)
    table = format_table(s)
    assert "failed 1  (http 503: 1)" in table and "45 of 100 prompt tokens" in table
    assert records[-1].as_dict()["ttft_s"] is None


def test_summary_counts_the_refused_share_and_deadline_expiries_apart():
    records = [_rec(i, 0.1) for i in range(5)] + [_rec(5 + i, math.nan, error="http 429") for i in range(4)]
    records += [_rec(9, math.nan, error="timeout"), _rec(10, math.nan, error="http 504"), _rec(11, math.nan, error="http 503")]
    s = summarize(records, slo_ttft_s=1.0)
    assert (s["requests"], s["refused"], s["refused_share"], s["deadline_expired"]) == (12, 4, 4 / 12, 2)
    assert "refused (429)   4 of 12 (33.3%); deadline expired 2" in format_table(s)
    quiet = summarize(records[:5], slo_ttft_s=1.0)
    assert (quiet["refused"], quiet["refused_share"], quiet["deadline_expired"]) == (0, 0.0, 0)
    assert "refused" not in format_table(quiet)


def test_summary_of_no_success_has_no_latencies():
    s = summarize([_rec(0, math.nan, error="timeout")], slo_ttft_s=1.0)
    assert s["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert (s["failed"], s["good_requests"], s["cached_reported"]) == (1, 0, 0)


def test_bad_config_is_a_usage_error():
    with pytest.raises(UsageError, match="--endpoint must be an http"):
        BenchConfig(endpoint="127.0.0.1:8000")
    with pytest.raises(UsageError, match="--rate-scale must be positive"):
        BenchConfig(endpoint="http://x", rate_scale=0)
    assert BenchConfig(endpoint="http://h:1/v1/").completions_url == "http://h:1/v1/completions"
    with pytest.raises(UsageError, match=r"--synthetic must be in \[1, "):
        synthetic_requests(0, 0, 16)


def test_synthetic_requests_come_from_the_generated_mix():
    reqs = synthetic_requests(5, 0, 16)
    assert [r.index for r in reqs] == [0, 1, 2, 3, 4]
    assert [r.timestamp_ms for r in reqs] == sorted(r.timestamp_ms for r in reqs)
    assert synthetic_requests(5, 0, 16)[3].hash_ids == reqs[3].hash_ids


async def test_cli_replays_a_trace_through_the_router(one_replica_stack, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.jsonl"
    # words per block 4: request 1 repeats request 0's first two blocks; request 2 shares nothing
    write_trace(trace, [
        {"timestamp": 0, "input_length": 12, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 12, "output_length": 3, "hash_ids": [1, 2, 4]},
        {"timestamp": 2, "input_length": 4, "output_length": 2, "hash_ids": [5]},
        {"timestamp": 3, "input_length": 4, "output_length": 2, "hash_ids": [6]},
    ])
    stack = one_replica_stack
    monkeypatch.setenv("UNICACHE_API_KEY", "key-acme")
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    rc = await asyncio.to_thread(main, [
        "bench", "--endpoint", stack.http_url, "--trace", str(trace), "--block-size", "4",
        "--max-requests", "3", "--max-concurrency", "1", "--rate-scale", "inf", "--no-progress",
        "--out", str(out), "--plot", str(plot),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert (s["requests"], s["succeeded"], s["failed"]) == (3, 3, 0)
    assert len(stack.served_ids()) == 3
    reqs = report["requests"]
    assert [r["index"] for r in reqs] == [0, 1, 2]
    assert [r["completion_tokens"] for r in reqs] == [3, 3, 2]
    # the byte-level test tokenizer: prompt tokens = bytes; the replica caches whole 16-token
    # blocks, so request 1 hits the blocks inside the text it shares with request 0
    texts = [prompt_text([1, 2, 3], 12, 4), prompt_text([1, 2, 4], 12, 4), prompt_text([5], 4, 4)]
    shared = len(os.path.commonprefix(texts[:2]))
    block = stack.replicas[0].engine.block_size
    assert [r["prompt_tokens"] for r in reqs] == [len(t.encode()) for t in texts] == [44, 49, 17]
    assert [r["cached_tokens"] for r in reqs] == [0, shared // block * block, 0] == [0, 32, 0]
    assert (s["cached_reported"], s["cached_tokens"], s["prompt_tokens"]) == (3, 32, 110)
    assert all(r["ttft_s"] > 0 and r["end_s"] >= r["sent_s"] + r["ttft_s"] for r in reqs)
    assert plot.stat().st_size > 0
    assert "api_key" not in report["config"]
    assert "succeeded 3  failed 0" in capsys.readouterr().out

    # a refused request is counted as failed, by kind, never dropped
    cfg = BenchConfig(endpoint=stack.http_url, api_key="wrong-key", rate_scale=math.inf)
    records = await run_bench(cfg, read_trace(trace)[:2])
    failed = summarize(records, 1.0)
    assert (failed["requests"], failed["succeeded"], failed["failed"], failed["errors"]) == (2, 0, 2, {"http 401": 2})


def _sse_stream(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("events, error, ttft, tokens", [
    # two tokens that decode to no text (e.g. special ids), then the usage event: a success
    (({"choices": [{"index": 0, "text": "", "finish_reason": None}]},
      {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}), None, True, 2),
    # only the usage event: nothing was streamed
    (({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}},), "no tokens", False, 0),
])
async def test_a_choice_is_a_token_event_even_with_empty_text(events, error, ttft, tokens):
    import httpx

    from unicache.bench_client.client import _one
    from unicache.sim.trace import TraceRequest

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, content=_sse_stream(*events), headers={"content-type": "text/event-stream"}))
    req = TraceRequest(index=0, timestamp_ms=0.0, input_length=4, output_length=2, hash_ids=[1])
    async with httpx.AsyncClient(transport=transport) as client:
        rec = await _one(client, BenchConfig(endpoint="http://x"), req, 0.0)
    assert (rec.error, not math.isnan(rec.ttft_s), rec.completion_tokens) == (error, ttft, tokens)
    assert len(rec.itl_s) == (1 if ttft else 0)


def test_fit_request_keeps_the_leading_words_that_fit_one_token_per_byte():
    from unicache.bench_client.prompts import SPECIAL_TOKENS_RESERVE, fit_request
    from unicache.sim.trace import TraceRequest

    req = TraceRequest(index=0, timestamp_ms=0.0, input_length=40, output_length=50, hash_ids=[7, 8, 9])
    assert fit_request(req, 16, 100_000) is req  # fits: unchanged
    cut = fit_request(req, 16, 120)
    full = prompt_text(req.hash_ids, req.input_length, 16)
    budget = 120 - 30 - SPECIAL_TOKENS_RESERVE  # max_tokens capped at a quarter of the context
    kept = prompt_text(cut.hash_ids, cut.input_length, 16)
    assert cut.output_length == 30 and full.startswith(kept)
    assert len(kept.encode()) <= budget < len(prompt_text(req.hash_ids, cut.input_length + 1, 16).encode())
    assert cut.hash_ids == [7, 8, 9][: -(-cut.input_length // 16)]
    with pytest.raises(ValueError, match="no room"):
        fit_request(req, 16, 10)


async def test_a_refusal_keeps_the_servers_code_and_message():
    import httpx

    from unicache.bench_client.client import _one
    from unicache.sim.trace import TraceRequest

    body = {"error": {"message": "prompt (5000 tokens) + max_tokens (90) exceeds the context of 4096",
                      "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"}}
    transport = httpx.MockTransport(lambda request: httpx.Response(400, json=body))
    req = TraceRequest(index=0, timestamp_ms=0.0, input_length=4, output_length=2, hash_ids=[1])
    async with httpx.AsyncClient(transport=transport) as client:
        rec = await _one(client, BenchConfig(endpoint="http://x"), req, 0.0)
    assert (rec.error, rec.error_code, rec.error_message) == ("http 400", "context_length_exceeded", body["error"]["message"])
    s = summarize([rec, rec], 1.0)
    assert s["errors"] == {"http 400": 2}
    assert s["error_details"] == [{"error": "http 400", "code": "context_length_exceeded", "count": 2, "message": body["error"]["message"]}]
    assert "  2 x http 400 context_length_exceeded: prompt (5000 tokens) + max_tokens (90) exceeds the context of 4096" in format_table(s)
    assert rec.as_dict()["error_code"] == "context_length_exceeded"


async def test_synthetic_prompts_are_sized_to_the_context_the_endpoint_reports(tmp_path, monkeypatch, capsys):
    from tests.support.load_stack import LoadStack
    from unicache.v1 import cache_pb2

    stack = await LoadStack.start(num_replicas=1, max_model_len=512)
    try:
        rep = stack.replicas[0]
        monkeypatch.setenv("UNICACHE_API_KEY", "key-acme")
        args = ["bench", "--endpoint", stack.http_url, "--synthetic", "6", "--rate-scale", "inf", "--no-progress"]
        # the context is too small for the mix: unsized, its long prompts are refused, each
        # failure with the server's code and message
        out = tmp_path / "unsized.json"
        assert await asyncio.to_thread(main, [*args, "--max-model-len", "100000", "--out", str(out)]) == 1
        report = json.loads(out.read_text())
        failed = [r for r in report["requests"] if r["error"]]
        assert failed and {(r["error"], r["error_code"]) for r in failed} == {("http 400", "context_length_exceeded")}
        assert all("exceeds the context of 512" in r["error_message"] for r in failed)
        assert f"{len(failed)} x http 400 context_length_exceeded: " in capsys.readouterr().out
        # the router announces the replica's context (its heartbeat): every prompt fits
        stack.app.cluster.upsert(rep.replica_id, rep.address, heartbeat=cache_pb2.Heartbeat(replica_id=rep.replica_id, max_model_len=512))
        out = tmp_path / "sized.json"
        assert await asyncio.to_thread(main, [*args, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert (report["summary"]["failed"], report["source"]["max_model_len"]) == (0, 512)
        assert all(r["prompt_tokens"] + r["completion_tokens"] <= 512 for r in report["requests"])
        assert f"context 512 tokens: {len(failed)} of 6 synthetic requests cut to fit" in capsys.readouterr().err
    finally:
        await stack.close()
