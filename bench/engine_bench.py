"""Engine benchmark: TTFT with a cached prefix vs cold, and decode throughput by batch size.

TTFT: a 2,000-token prompt whose first 1,900 tokens are in the prefix cache (a previous
request computed them) against the same-length prompt on a cold cache, on the default
model (seeded random weights). Each figure is the median of ``--reps`` runs measured in
the same process; the headline is the ratio warm / cold (target <= 0.2).

Decode: B requests (distinct 64-token prompts) decode ``--decode-tokens`` tokens together;
tokens/s counts only steps in which every scheduled token is a decode token.

Run: .venv/bin/python -m bench.engine_bench [--device auto] [--threads N] [--json bench/results/engine_bench.json]

NOTE: OMP_WAIT_POLICY defaults to PASSIVE here (set before torch loads). On a shared,
oversubscribed CPU host, spinning OpenMP workers wait on peers that are descheduled and
small matmuls get 10-40x slower; passive waiting removes that pathology. Export
OMP_WAIT_POLICY=ACTIVE to measure torch's default behaviour.
"""

from __future__ import annotations

import os

from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait  # noqa: E402 - before torch

prefer_passive_omp_wait()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.engine import LLMEngine


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token; and the cached token count."""
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    while True:
        outs = engine.step()
        if outs:
            dt = time.perf_counter() - t0
            assert outs[0].finished and not engine.has_unfinished()
            return dt, outs[0].usage.cached_tokens


def bench_ttft(engine: LLMEngine, prompt_len: int, cached_len: int, reps: int) -> dict:
    engine.store.reset_cache(0.0)
    _ttft(engine, "warmup", _tokens(999, prompt_len))
    cold, warm, hits = [], [], []
    for r in range(reps):
        engine.store.reset_cache(0.0)
        cold.append(_ttft(engine, f"cold{r}", _tokens(100 + r, prompt_len))[0])
        prefix = _tokens(200 + r, cached_len)
        engine.store.reset_cache(0.0)
        _ttft(engine, f"prime{r}", prefix)
        dt, cached = _ttft(engine, f"warm{r}", prefix + _tokens(300 + r, prompt_len - cached_len))
        warm.append(dt)
        hits.append(cached)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": prompt_len,
        "cached_prefix_tokens": cached_len,
        "cached_tokens_reported": hits[0],
        "ttft_cold_s": cold_s,
        "ttft_warm_s": warm_s,
        "ratio_warm_over_cold": warm_s / cold_s,
        "reps": reps,
    }


def bench_decode(engine: LLMEngine, batch: int, prompt_len: int, decode_tokens: int) -> dict:
    engine.store.reset_cache(0.0)
    for i in range(batch):
        sp = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        engine.add_request(EngineRequest(f"d{batch}-{i}", _tokens(1000 + i, prompt_len), sp))
    tokens = 0
    elapsed = 0.0
    while engine.has_unfinished():
        pure_decode = all(len(s.token_ids) - s.num_computed == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if pure_decode:
            elapsed += dt
            tokens += sum(len(o.new_token_ids) for o in outs)
    return {"batch": batch, "decode_tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--cached", type=int, default=1900)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", default="bench/results/engine_bench.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = EngineConfig(device=args.device, num_blocks=2048, max_num_batched_tokens=max(2048, args.prompt))
    engine = LLMEngine(config)
    print(
        f"device={engine.device} dtype={engine.dtype} threads={torch.get_num_threads()} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} model={config.model}"
    )
    ttft = bench_ttft(engine, args.prompt, args.cached, args.reps)
    print(
        f"TTFT {args.prompt}-token prompt: cold {ttft['ttft_cold_s'] * 1e3:.1f} ms, "
        f"{ttft['cached_tokens_reported']} cached {ttft['ttft_warm_s'] * 1e3:.1f} ms, "
        f"ratio {ttft['ratio_warm_over_cold']:.3f} (target <= 0.2)"
    )
    bench_decode(engine, 2, args.decode_prompt, 8)  # warm-up
    decode = []
    for b in (int(x) for x in args.batches.split(",")):
        d = bench_decode(engine, b, args.decode_prompt, args.decode_tokens)
        decode.append(d)
        d["speedup_vs_first_batch"] = d["decode_tokens_per_s"] / decode[0]["decode_tokens_per_s"]
        print(f"decode batch {b:>3}: {d['decode_tokens_per_s']:.1f} tokens/s (x{d['speedup_vs_first_batch']:.2f})")
    assert engine.num_referenced_blocks() == 0
    result = {
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "machine": platform.machine(),
        "ttft": ttft,
        "decode": decode,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
