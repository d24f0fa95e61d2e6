"""``unicache bench``: replay a trace against any OpenAI-compatible endpoint and measure it.

Each trace request becomes one streaming ``POST {endpoint}/v1/completions`` (prompt from
``unicache.bench_client.prompts``, ``max_tokens`` = its ``output_length`` (at least 1),
temperature 0, ``stream_options.include_usage``), sent at ``timestamp / rate_scale`` after
the start (``rate_scale`` inf: all at once), with at most ``max_concurrency`` in flight.
Any non-200 answer, transport error, timeout or error event in the stream counts as a
failed request (by kind), with the server's error ``code`` and ``message`` when it sent
one; nothing is retried. Statistics: ``unicache.bench_client.stats``.

``--synthetic`` sizes its prompts to the endpoint: the context is ``--max-model-len``, else
the ``max_model_len`` of the model's card in ``GET /v1/models`` (vLLM and the UniCache
router report it); each request is cut to fit it (``bench_prompts.fit_request``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from unicache.bench_client.prompts import fit_request, prompt_text
from unicache.bench_client.stats import RequestRecord, format_table, plot_ttft_cdf, summarize
from unicache.plumbing.errors import UsageError
from unicache.plumbing.sse import sse_events
from unicache.sim.trace import TraceError, TraceRequest, parse_trace_line, read_trace
from unicache.sim.workload import WorkloadConfig, generate

API_KEY_ENV = "UNICACHE_API_KEY"


@dataclass(slots=True)
class BenchConfig:
    """One run. ``endpoint``: base URL, with or without a trailing ``/v1``.

    Args:
        model: the ``model`` field sent (default ``unicache-default``).
        block_size: words per hash-id block of the prompt text (default 16).
        rate_scale: arrival times are divided by it (default 1: the trace's pace).
        max_requests: replay only the first N requests by time (default all).
        max_concurrency: most requests in flight (default 0: no limit).
        timeout_s: deadline per request (default 300), sent as ``x-stainless-read-timeout``
            as OpenAI's SDK sends its own.
        slo_ttft_s: the TTFT SLO of goodput (default 1).
    """

    endpoint: str
    model: str = "unicache-default"
    api_key: str | None = None
    block_size: int = 16
    rate_scale: float = 1.0
    max_requests: int | None = None
    max_concurrency: int = 0
    timeout_s: float = 300.0
    slo_ttft_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise UsageError(f"--endpoint must be an http(s) URL, got {self.endpoint!r}")
        for name in ("block_size", "rate_scale", "timeout_s", "slo_ttft_s"):
            if not getattr(self, name) > 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_requests is not None and self.max_requests < 1:
            raise UsageError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.max_concurrency < 0:
            raise UsageError(f"--max-concurrency must be >= 0, got {self.max_concurrency}")

    @property
    def completions_url(self) -> str:
        return self.base_url + "/v1/completions"

    @property
    def base_url(self) -> str:
        base = self.endpoint.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base


def served_context(cfg: BenchConfig, timeout_s: float = 10.0) -> int | None:
    """``max_model_len`` of ``cfg.model`` in the endpoint's ``GET /v1/models`` (None when
    the endpoint does not report one or cannot be asked)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        resp = httpx.get(cfg.base_url + "/v1/models", headers=headers, timeout=timeout_s)
        cards = resp.json().get("data", []) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == cfg.model and isinstance(card.get("max_model_len"), int):
            return card["max_model_len"]
    return None


def fit_to_context(requests: list[TraceRequest], block_size: int, max_model_len: int) -> tuple[list[TraceRequest], int]:
    """``requests`` each cut to the context (``bench_prompts.fit_request``), and how many
    were cut."""
    try:
        fitted = [fit_request(r, block_size, max_model_len) for r in requests]
    except ValueError as exc:
        raise UsageError(f"--max-model-len {max_model_len}: {exc}") from None
    return fitted, sum(1 for a, b in zip(requests, fitted) if a is not b)


def _server_error(payload: object) -> tuple[str | None, str | None]:
    """(code, message) of an OpenAI-style error body or stream event (None each when absent)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return (None if code is None else str(code)), (None if err.get("message") is None else str(err["message"]))
    if isinstance(err, str):
        return None, err
    return None, None


def synthetic_requests(n: int, seed: int, block_size: int) -> list[TraceRequest]:
    """The first ``n`` requests (by time) of the generated mix (``unicache gen-workload``
    defaults with ``seed`` and ``block_size``), read by the one trace reader."""
    records = generate(WorkloadConfig(seed=seed, block_size=block_size))
    if n < 1 or n > len(records):
        raise UsageError(f"--synthetic must be in [1, {len(records)}], got {n}")
    return [parse_trace_line(json.dumps(r), "<synthetic>", i + 1, i) for i, r in enumerate(records[:n])]


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, req: TraceRequest, t0: float) -> RequestRecord:
    body = {
        "model": cfg.model,
        "prompt": prompt_text(req.hash_ids, req.input_length, cfg.block_size),
        "max_tokens": max(1, req.output_length),
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    rec = RequestRecord(index=req.index, sent_s=sent - t0)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", cfg.completions_url, json=body, timeout=cfg.timeout_s) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"http {resp.status_code}"
                try:
                    rec.error_code, rec.error_message = _server_error(json.loads(raw))
                except ValueError:
                    rec.error_message = raw[:500].decode(errors="replace") or None
                return rec
            async for event in sse_events(resp):
                if "error" in event:
                    rec.error = "stream error"
                    rec.error_code, rec.error_message = _server_error(event)
                    return rec
                now = time.perf_counter()
                # NOTE: a choice is a token event even with empty text (a special token, or a
                # UTF-8 byte the detokenizer holds back), as vLLM's benchmark counts it; the
                # usage-only event has no choices.
                if event.get("choices"):
                    chunks += 1
                    if last is None:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
        if last is None:
            rec.error = "no tokens"
        elif rec.prompt_tokens is None:
            rec.completion_tokens = chunks  # NOTE: no usage reported: one token per text chunk
    except httpx.TimeoutException:
        rec.error = "timeout"
        rec.error_message = f"no answer within {cfg.timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = type(exc).__name__
        rec.error_message = str(exc) or None
    finally:
        rec.end_s = time.perf_counter() - t0
    return rec


async def run_bench(cfg: BenchConfig, requests: list[TraceRequest], *, progress: bool = False) -> list[RequestRecord]:
    """Replay ``requests`` (sorted by time) against ``cfg.endpoint``; records in trace order."""
    from tqdm import tqdm

    reqs = requests[: cfg.max_requests] if cfg.max_requests else requests
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # NOTE: the client's deadline, declared as OpenAI's SDK declares it: a router with
    # overload bounds refuses at once (429) what it predicts cannot start in time.
    headers["x-stainless-read-timeout"] = f"{cfg.timeout_s:g}"
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(reqs), unit="req", disable=not progress, file=sys.stderr)
    base_ms = reqs[0].timestamp_ms if reqs else 0.0
    # NOTE: idle connections expire before the server's 5 s keep-alive (uvicorn's default, the
    # router's): at equal timeouts a request sent on a connection the server is closing
    # fails with a ReadError (one in 400 at 4x the capacity in bench.overload_sweep).
    limits = httpx.Limits(max_connections=cfg.max_concurrency or None, max_keepalive_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=cfg.timeout_s) as client:
        t0 = time.perf_counter()

        async def fire(req: TraceRequest) -> RequestRecord:
            if gate is None:
                rec = await _one(client, cfg, req, t0)
            else:
                async with gate:
                    rec = await _one(client, cfg, req, t0)
            bar.update(1)
            return rec

        tasks = []
        for req in reqs:
            due = 0.0 if math.isinf(cfg.rate_scale) else (req.timestamp_ms - base_ms) / 1000.0 / cfg.rate_scale
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(req)))
        records = await asyncio.gather(*tasks)
    bar.close()
    return list(records)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="replay a trace against an OpenAI-compatible endpoint; TTFT, ITL, throughput, goodput, cached tokens")
    p.add_argument("--endpoint", required=True, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="JSON Lines trace (docs/trace-format.md); one ships: "
                     "traces/mooncake-conversation-slice.jsonl (with --block-size 512)")
    src.add_argument("--synthetic", type=int, metavar="N", help="the first N requests of the generated mix (gen-workload defaults)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="the endpoint's context: --synthetic cuts its prompts to fit it "
                        "(default: the model's max_model_len in GET /v1/models)")
    p.add_argument("--model", default="unicache-default", help="model name sent (default unicache-default)")
    p.add_argument("--api-key", default=None, help=f"API key (default: env {API_KEY_ENV}; a flag is visible to other users)")
    p.add_argument("--block-size", type=int, default=16, help="words of prompt text per hash id (default 16; Mooncake: 512)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="divide arrival times by this (default 1; inf: all at once)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (default 0: no limit)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline per request (default 300)")
    p.add_argument("--slo-ttft-s", type=float, default=1.0, help="TTFT SLO of goodput, seconds (default 1)")
    p.add_argument("--out", metavar="FILE.json", help="write the summary and every request record as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write the TTFT CDF")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    api_key = args.api_key
    if api_key is not None:
        print(f"unicache bench: warning: --api-key is visible in the process list; prefer env {API_KEY_ENV}", file=sys.stderr)
    else:
        api_key = os.environ.get(API_KEY_ENV) or None
    cfg = BenchConfig(
        endpoint=args.endpoint, model=args.model, api_key=api_key, block_size=args.block_size,
        rate_scale=args.rate_scale, max_requests=args.max_requests, max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s, slo_ttft_s=args.slo_ttft_s,
    )
    context = None
    if args.trace:
        try:
            requests = read_trace(args.trace)
        except TraceError as exc:
            raise UsageError(str(exc)) from None
    else:
        requests = synthetic_requests(args.synthetic, args.seed, args.block_size)
        context = args.max_model_len if args.max_model_len is not None else served_context(cfg)
        if context is None:
            print(f"unicache bench: warning: {cfg.base_url}/v1/models reports no max_model_len for {cfg.model!r}; "
                  "prompts are not sized to the context (set --max-model-len)", file=sys.stderr)
        else:
            requests, cut = fit_to_context(requests, args.block_size, context)
            print(f"unicache bench: context {context} tokens: {cut} of {len(requests)} synthetic requests cut to fit",
                  file=sys.stderr)
    records = asyncio.run(run_bench(cfg, requests, progress=not args.no_progress))
    summary = summarize(records, cfg.slo_ttft_s)
    print(format_table(summary))
    if args.out:
        config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        source = {"trace": args.trace} if args.trace else {"synthetic": args.synthetic, "seed": args.seed, "max_model_len": context}
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"config": config, "source": source, "summary": summary,
                       "requests": [r.as_dict() for r in records]}, fh, indent=1, default=str)
    if args.plot:
        plot_ttft_cdf(records, args.plot, cfg.slo_ttft_s)
    return 0 if summary["failed"] == 0 else 1
