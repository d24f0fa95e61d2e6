"""The live A/B's measuring side: the open-loop replay through one router, the vLLM
servers' prefix-cache counters and a process tree's CPU (bench/live_ab.py).

A request is one streaming ``POST /v1/completions`` (temperature 0, the tenant's API key,
``x-session-id`` where the trace has a session); TTFT is sent -> the first event carrying a
choice, E2E sent -> the end of the stream. A non-200 answer, an error event, a stream
without a choice, a transport error or a timeout fails the request; nothing is retried.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import httpx
import psutil

from bench.live_ab_workload import LiveRequest
from unicache.plumbing.sse import sse_events
from unicache.router.upstream.vllm_fleet.follower import parse_vllm_metrics



@dataclass(slots=True)
class Outcome:
    """One replayed request: ``error`` None when it succeeded."""

    index: int
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    cached_tokens: int | None = None
    prompt_tokens: int | None = None  # from the final usage, with cached_tokens
    tokens: int = 0  # events carrying a choice (one token each from vLLM)
    error: str | None = None


async def send(client: httpx.AsyncClient, url: str, model: str, req: LiveRequest, key: str, timeout_s: float) -> Outcome:
    """Send ``req`` to ``url`` (a router's base URL) and time it."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"authorization": f"Bearer {key}"}
    if req.session_id is not None:
        headers["x-session-id"] = req.session_id
    # NOTE: the trace's task and template labels go with it, as they go to the simulator's
    # copy of the workload: inferred from arrival gaps instead, a replay at rate scale 4-16
    # made chat sessions look like agents (our router infers agent below a 15 s gap), and
    # UniCache inside vLLM then filed them in the agent lane. The peers ignore the headers.
    if req.source.task is not None:
        headers["x-unicache-task"] = getattr(req.source.task, "value", req.source.task)
    if req.source.template is not None:
        headers["x-unicache-template"] = "true" if req.source.template else "false"
    out = Outcome(req.index)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                out.error = f"http {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return out
            async for event in sse_events(resp):
                if "error" in event:
                    out.error = f"stream error: {str(event['error'])[:200]}"
                    return out
                if event.get("choices"):
                    out.tokens += 1
                    if math.isnan(out.ttft_s):
                        out.ttft_s = time.perf_counter() - t0
                usage = event.get("usage") or {}
                if usage.get("prompt_tokens") is not None:
                    out.prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
        out.e2e_s = time.perf_counter() - t0
        if math.isnan(out.ttft_s):
            out.error = "no tokens"
    except httpx.TimeoutException:
        out.error = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def replay(url: str, model: str, requests: list[LiveRequest], keys: dict[str, str], rate_scale: float,
                 timeout_s: float = 600.0, on_done=None) -> list[Outcome]:
    """Send every request at ``at_s / rate_scale`` after the start (open loop: arrivals
    never wait for answers); outcomes in request order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = time.perf_counter()

        async def one(r: LiveRequest) -> Outcome:
            o = await send(client, url, model, r, keys[r.tenant], timeout_s)
            if on_done is not None:
                on_done()
            return o

        tasks = []
        for r in requests:
            delay = t0 + r.at_s / rate_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r)))
        return list(await asyncio.gather(*tasks))


TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on a Prometheus page, over its label sets."""
    return series_total(text, f"{name}_sum"), series_total(text, f"{name}_count")


def series_total(text: str, name: str) -> float:
    """The samples of series ``name`` (a counter, a histogram's ``_sum``) on a Prometheus
    page, summed over their label sets."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0] == name:
            total += float(value)
    return total


class FleetCounters(NamedTuple):
    """What vLLM servers count, summed over them: prefix-cache hits and queries (prompt
    tokens), and their own TTFT histogram's sum (s) and count: the time each request
    spent inside vLLM until its first token, without the router's part."""

    hits: float
    queries: float
    ttft_sum_s: float
    ttft_count: float

    def plus(self, other: FleetCounters) -> FleetCounters:
        return FleetCounters(*(a + b for a, b in zip(self, other)))

    def minus(self, before: FleetCounters) -> FleetCounters:
        return FleetCounters(*(a - b for a, b in zip(self, before)))


def server_counters(url: str, timeout_s: float = 10.0) -> FleetCounters:
    """``FleetCounters`` of the one vLLM server at ``url`` (one ``/metrics`` scrape)."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    stats = parse_vllm_metrics(text)
    return FleetCounters(stats.get("prefix_hits", 0.0), stats.get("prefix_queries", 0.0),
                         *histogram_totals(text, TTFT_HISTOGRAM))


def prefix_counters(url: str, timeout_s: float = 10.0) -> tuple[float, float]:
    """(hits, queries) of a vLLM server's ``vllm:prefix_cache_{hits,queries}_total``
    (prompt tokens, summed over label sets)."""
    counters = server_counters(url, timeout_s)
    return counters.hits, counters.queries


def fleet_counters(urls: list[str], timeout_s: float = 10.0) -> FleetCounters:
    """``server_counters`` summed over the servers at ``urls``."""
    out = FleetCounters(0.0, 0.0, 0.0, 0.0)
    for u in urls:
        out = out.plus(server_counters(u, timeout_s))
    return out


def process_tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and its live descendants ([] when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants."""
    total = 0.0
    for p in process_tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_runqueue_wait_s(pid: int) -> float:
    """Seconds the live threads of process ``pid`` and its descendants have spent runnable
    but waiting for a core (the second field of each ``/proc/PID/task/TID/schedstat``):
    what sharing the cores with the engines costs a router, apart from its own CPU."""
    total_ns = 0
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    total_ns += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return total_ns / 1e9
