"""vLLM as the replica's engine, measured on CPU with a tiny random-weight Llama it writes.

Three parts (``--parts``, default all):

* ``ttft``: a 2,000-token prompt whose first 1,900 tokens were computed by an earlier
  request (1,888 = 59 blocks of 32 cached) against a cold 2,000-token prompt: TTFT through
  the router (gRPC), through the replica (gRPC, ``--engine vllm``) and vLLM alone (a stock
  ``AsyncLLM``, none of our hooks). Medians of ``--reps``.
* ``trace``: the first ``--trace-requests`` requests of the Mooncake conversation trace
  replayed live, one at a time, through one vLLM engine with ``unicache`` and with ``lru``
  deciding vLLM's victims, and ``unicache sim`` on the same slice with the same capacity.
  Prompts are synthesized from hash ids, 32 tokens per id (one vLLM block), seeded by the
  id, so equal ids give equal tokens; each request decodes 16 tokens. The pool is
  ``--pool-frac`` of the slice's unique blocks (at least the longest request).
* ``engines``: the built-in torch engine against vLLM on the same tiny checkpoint: TTFT and
  decode tokens/s with 1, 8 and 32 concurrent requests (256-token prompts, 64 tokens each).

Run: nice -n 10 .venv/bin/python -m bench.vllm_engine [--json bench/results/vllm_engine.json]
(needs the [vllm] extra). No GPU is used; wall-clock figures are indicative on a shared
host, ratios are within one run.
"""

from __future__ import annotations

from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait  # noqa: E402 - before torch

prefer_passive_omp_wait()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from unicache.contract.request_class import RequestClass  # noqa: E402
from unicache.replica.engines.api import EngineRequest, SamplingParams  # noqa: E402
from unicache.replica.engines.vllm.config import VLLMEngineConfig  # noqa: E402
from unicache.replica.engines.vllm.engine import VLLMEngine  # noqa: E402
from unicache.testing.tiny_hf_model import VOCAB_SIZE, write_tiny_llama  # noqa: E402
from bench.paths import RESULTS, mooncake_trace  # noqa: E402

BS = 32


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


async def first_token(stream) -> float:
    """Seconds until the stream's first item; drains the rest."""
    t0 = time.perf_counter()
    dt = None
    async for _ in stream:
        if dt is None:
            dt = time.perf_counter() - t0
    return dt


# ---------------------------------------------------------------------------------- ttft
async def ttft_part(model_dir: str, reps: int) -> dict:
    prompts = [(tokens(100 + r, 1900), tokens(200 + r, 100), tokens(300 + r, 100), tokens(400 + r, 2000)) for r in range(reps)]

    async def measure(send) -> dict:
        cold, warm = [], []
        await send(tokens(7, 2000))  # warm-up
        for prefix, a, b, fresh in prompts:
            cold.append(await send(fresh))
            await send(prefix + a)
            warm.append(await send(prefix + b))
        return {"cold_s": statistics.median(cold), "cached_s": statistics.median(warm), "ratio": statistics.median(warm) / statistics.median(cold)}

    out = {}
    # vLLM alone: a stock AsyncLLM (no scheduler of ours, no events).
    from vllm import SamplingParams as VSP
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = VLLMEngineConfig(model=model_dir, num_blocks=256, eviction_policy="vllm", device="cpu", dtype="float32").engine_args(
        "cpu", "ipc:///tmp/unused-e", "ipc:///tmp/unused-r", ""
    )
    for ours in ("scheduler_cls", "additional_config", "kv_events_config"):
        args.pop(ours)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    n = [0]

    async def alone(ids):
        n[0] += 1
        return await first_token(llm.generate({"prompt_token_ids": ids}, VSP(max_tokens=2, ignore_eos=True), f"a{n[0]}"))

    try:
        out["vllm_alone"] = await measure(alone)
    finally:
        llm.shutdown()

    # Our replica (gRPC) and our router in front of it.
    import grpc

    from unicache.plumbing.redis_server import EmbeddedRedis
    from unicache.replica.runtime import ReplicaRuntime
    from unicache.replica.settings import ReplicaSettings
    from unicache.router.app import RouterApp
    from unicache.router.config import build_config
    from unicache.contract.state_auth import CallCredential, new_cluster_key, parse_cluster_key
    from unicache.testing.polling import eventually
    from unicache.contract.tokenizer import load_tokenizer
    from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc

    tok = load_tokenizer(f"{model_dir}/tokenizer.json")
    key = new_cluster_key()  # a fresh cluster: replicas sign their state, calls carry the credential
    credential = CallCredential(parse_cluster_key(key)).metadata()
    redis = EmbeddedRedis()
    redis.start()
    runtime = ReplicaRuntime(
        ReplicaSettings(replica_id="v0", engine="vllm", checkpoint=model_dir, block_size=BS, num_blocks=256, device="cpu", dtype="float32", redis_url=redis.url, redis_prefix="bench", cluster_key=key, insecure_no_tls=True)
    )
    address = await runtime.start()
    app = RouterApp(build_config(env={}, overrides={"grpc_port": 0, "http_port": 0, "redis_url": redis.url, "redis_prefix": "bench", "block_size": BS, "tokenizer": f"{model_dir}/tokenizer.json", "auth_enabled": False, "cluster_key": key, "insecure_no_tls": True}))
    await app.start()
    try:
        await eventually(lambda: "v0" in app.cluster.replicas, "replica seen", timeout_s=60)
        rch, ach = grpc.aio.insecure_channel(address), grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
        replica, router = replica_pb2_grpc.ReplicaStub(rch), router_pb2_grpc.RouterStub(ach)
        sampling = common_pb2.SamplingParams(max_tokens=2)

        async def via_replica(ids):
            req = replica_pb2.GenerateRequest(sampling=sampling)
            req.token_ids.ids.extend(ids)
            return await first_token(replica.Generate(req, metadata=credential, timeout=300))

        async def via_router(ids):
            # NOTE: text of the word tokenizer: one token per word, so the router's ids are these.
            req = router_pb2.RouterGenerateRequest(text=tok.decode(ids), sampling=sampling)
            return await first_token(router.Generate(req, timeout=300))

        out["replica"] = await measure(via_replica)
        out["router"] = await measure(via_router)
        await rch.close()
        await ach.close()
    finally:
        await app.stop()
        await runtime.stop()
        redis.close()
    out["wrapper_overhead_cached"] = out["replica"]["cached_s"] / out["vllm_alone"]["cached_s"]
    return out


# --------------------------------------------------------------------------------- trace
def trace_slice(path: Path, n: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def id_tokens(hid: int) -> list[int]:
    return tokens(1_000_003 * hid + 17, BS)


async def replay(engine: VLLMEngine, rows: list[dict], out_tokens: int) -> dict:
    hit = query = 0
    for i, r in enumerate(rows):
        prompt = [t for h in r["hash_ids"] for t in id_tokens(h)]
        req = EngineRequest(f"t{i}", prompt, SamplingParams(max_tokens=out_tokens, ignore_eos=True), cls=RequestClass())
        last = None
        async for o in engine.generate(req):
            last = o
        hit += last.usage.cached_tokens // BS
        query += len(r["hash_ids"])
    return {"hit_blocks": hit, "query_blocks": query, "hit_ratio": hit / query, "evictions": engine.cache_state().evictions}


def sim(rows: list[dict], capacity: int, out_tokens: int, policies: list[str], tmp: str) -> dict:
    path = Path(tmp) / "slice.jsonl"
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r["timestamp"], "input_length": len(r["hash_ids"]) * BS, "output_length": out_tokens, "hash_ids": r["hash_ids"]}) + "\n")
    res = Path(tmp) / "sim.json"
    subprocess.run(
        [sys.executable, "-m", "unicache.cli.main", "sim", "--trace", str(path), "--block-size", str(BS), "--capacity-blocks", str(capacity), "--policies", ",".join(policies), "--json", str(res), "--no-progress"],
        check=True, stdout=subprocess.DEVNULL,
    )
    return json.loads(res.read_text())


async def trace_part(model_dir: str, n: int, pool_frac: float, out_tokens: int, trace: Path) -> dict:
    rows = trace_slice(trace, n)
    unique = len({h for r in rows for h in r["hash_ids"]})
    longest = max(len(r["hash_ids"]) for r in rows) + -(-out_tokens // BS) + 1
    pool = max(int(unique * pool_frac), longest)
    out = {"requests": len(rows), "unique_blocks": unique, "pool_blocks": pool, "tokens_per_hash_id": BS, "out_tokens": out_tokens}
    for policy in ("unicache", "lru"):
        engine = VLLMEngine(VLLMEngineConfig(model=model_dir, num_blocks=pool, eviction_policy=policy, device="cpu", dtype="float32", max_num_seqs=4))
        await engine.start()
        try:
            t0 = time.perf_counter()
            out[f"live_{policy}"] = await replay(engine, rows, out_tokens)
            out[f"live_{policy}"]["wall_s"] = time.perf_counter() - t0
        finally:
            await engine.stop()
    with tempfile.TemporaryDirectory() as tmp:
        out["sim"] = sim(rows, pool, out_tokens, ["lru", "unicache"], tmp)
    return out


# ------------------------------------------------------------------------------- engines
async def batch_run(engine, batch: int, prompt_len: int, out_tokens: int, seed: int) -> dict:
    firsts, ends = [], []

    async def one(i):
        req = EngineRequest(f"b{seed}-{batch}-{i}", tokens(seed * 1000 + i, prompt_len), SamplingParams(max_tokens=out_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        first = None
        async for _ in engine.generate(req):
            if first is None:
                first = time.perf_counter()
        firsts.append(first - t0)
        ends.append((first, time.perf_counter()))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(batch)))
    decode_start = max(f for f, _ in ends)
    decode_end = max(e for _, e in ends)
    # Decode tokens/s: tokens after each request's first, over the span from the last first token
    # to the last token (every request is decoding then).
    return {"ttft_s": statistics.median(firsts), "decode_tok_s": batch * (out_tokens - 1) / max(decode_end - decode_start, 1e-9), "wall_s": time.perf_counter() - t0}


async def engines_part(model_dir: str, batches: list[int], prompt_len: int, out_tokens: int) -> dict:
    from unicache.replica.engines.builtin.async_engine import AsyncEngine
    from unicache.replica.engines.builtin.config import EngineConfig

    out = {"prompt_tokens": prompt_len, "out_tokens": out_tokens}
    engines = {
        "torch": lambda: AsyncEngine(EngineConfig(checkpoint=model_dir, block_size=BS, num_blocks=1024, eviction_policy="lru", device="cpu", dtype="float32", max_num_seqs=32, cpu_threads=1)),
        "vllm": lambda: VLLMEngine(VLLMEngineConfig(model=model_dir, num_blocks=1024, eviction_policy="lru", device="cpu", dtype="float32", max_num_seqs=32)),
    }
    for name, build in engines.items():
        engine = build()
        await engine.start()
        try:
            await batch_run(engine, 1, prompt_len, 4, seed=99)  # warm-up
            out[name] = {str(b): await batch_run(engine, b, prompt_len, out_tokens, seed=b) for b in batches}
        finally:
            await engine.stop()
    return out


def markdown(res: dict) -> str:
    lines = ["# vLLM engine on CPU (tiny random-weight Llama; no GPU lent to this run)", ""]
    if "ttft" in res:
        t = res["ttft"]
        lines += ["## TTFT, 2,000-token prompt: 1,900 tokens cached vs cold (median)", "", "| path | cold s | cached s | cached / cold |", "|---|---|---|---|"]
        for k in ("vllm_alone", "replica", "router"):
            lines.append(f"| {k} | {t[k]['cold_s']:.3f} | {t[k]['cached_s']:.3f} | {t[k]['ratio']:.2f} |")
        lines += ["", f"Replica / vLLM alone, cached: {t['wrapper_overhead_cached']:.2f}x", ""]
    if "trace" in res:
        t = res["trace"]
        lines += [
            f"## Hit ratio inside vLLM: first {t['requests']} Mooncake conversation requests", "",
            f"{t['unique_blocks']} unique blocks, pool {t['pool_blocks']} blocks ({t['pool_blocks'] / t['unique_blocks']:.1%}), {t['tokens_per_hash_id']} tokens per hash id, {t['out_tokens']} output tokens.", "",
            "| policy | live block hit ratio (vLLM) | simulated block hit ratio |", "|---|---|---|",
        ]
        for p in ("unicache", "lru"):
            simr = next(r for r in t["sim"]["results"] if r["policy"] == p)
            sim_hr = f"{simr['block_hit_ratio']:.4f}"
            lines.append(f"| {p} | {t[f'live_{p}']['hit_ratio']:.4f} | {sim_hr} |")
        lines.append("")
    if "engines" in res:
        e = res["engines"]
        lines += [f"## Built-in torch engine vs vLLM ({e['prompt_tokens']}-token prompts, {e['out_tokens']} tokens each)", "", "| batch | torch TTFT s | vLLM TTFT s | torch decode tok/s | vLLM decode tok/s |", "|---|---|---|---|---|"]
        for b in e["torch"]:
            lines.append(f"| {b} | {e['torch'][b]['ttft_s']:.3f} | {e['vllm'][b]['ttft_s']:.3f} | {e['torch'][b]['decode_tok_s']:.0f} | {e['vllm'][b]['decode_tok_s']:.0f} |")
    return "\n".join(lines) + "\n"


async def main_async(a) -> dict:
    res: dict = {"command": "python -m bench.vllm_engine " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(f"{tmp}/tiny-llama", max_position=8192)
        parts = a.parts.split(",")
        if "ttft" in parts:
            res["ttft"] = await ttft_part(model_dir, a.reps)
        if "trace" in parts:
            res["trace"] = await trace_part(model_dir, a.trace_requests, a.pool_frac, 16, Path(a.trace or mooncake_trace()))
        if "engines" in parts:
            res["engines"] = await engines_part(model_dir, [int(b) for b in a.batches.split(",")], 256, 64)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="ttft,trace,engines")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--trace", default=None, help="Mooncake conversation trace (default: shared/traces)")
    p.add_argument("--trace-requests", type=int, default=300)
    p.add_argument("--pool-frac", type=float, default=0.03)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--json", default=str(RESULTS / "vllm_engine.json"))
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    Path(a.json).write_text(json.dumps(res, indent=2))
    Path(a.json).with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
