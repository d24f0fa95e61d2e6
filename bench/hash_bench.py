"""Measure the chained block hash (xxh3-128) against cryptographic alternatives.

Hashes the same random token stream in 16-token blocks with each function through the
same chaining code and reports blocks/s and the ratio to sha256 measured in the same run;
also the project's ``hash_block``, and a salted prompt of 256 and 8,000 tokens hashed by
``hash_token_blocks`` (one pass, as router and replicas hash a prompt) against block by
block with ``hash_block`` (the definition).

Run: .venv/bin/python -m bench.hash_bench [--blocks 200000] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
import timeit
from array import array

import xxhash

from unicache.contract.block_hash import ROOT_HASH, block_extra_keys, hash_block, hash_token_blocks


def _chain(make, blocks: list[list[int]]) -> None:
    parent = ROOT_HASH
    for toks in blocks:
        h = make(parent)
        h.update(array("I", toks).tobytes())
        parent = h.digest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(0)
    blocks = [[rng.randrange(32000) for _ in range(args.block_size)] for _ in range(args.blocks)]
    candidates = {
        "sha256": hashlib.sha256,
        "blake2b-128": lambda d: hashlib.blake2b(d, digest_size=16),
        "xxh3-128 (raw)": xxhash.xxh3_128,
    }
    results = {}
    for name, make in candidates.items():
        t0 = time.perf_counter()
        _chain(make, blocks)
        results[name] = args.blocks / (time.perf_counter() - t0)
    # The project's function, including its extra-key handling.
    t0 = time.perf_counter()
    parent = ROOT_HASH
    for toks in blocks:
        parent = hash_block(parent, toks)
    results["unicache.contract.block_hash.hash_block"] = args.blocks / (time.perf_counter() - t0)
    base = results["sha256"]
    print(f"{'hash':34s} {'blocks/s':>12s} {'vs sha256':>10s}")
    for name, rate in results.items():
        print(f"{name:34s} {rate:12,.0f} {rate / base:9.2f}x")
    # A salted prompt hashed whole (hash_token_blocks: one pass) against block by block
    # (hash_block per block with its extra keys: the definition, as it was computed before).
    prompts = {}
    salt = b"0123456789abcdef"
    for n in (256, 8000):
        ids = [rng.randrange(32000) for _ in range(n)]

        def by_block(ids=ids):
            parent = ROOT_HASH
            for i in range(len(ids) // args.block_size):
                parent = hash_block(parent, ids[i * args.block_size : (i + 1) * args.block_size], block_extra_keys(i, salt, None))

        whole = min(timeit.repeat(lambda ids=ids: hash_token_blocks(ids, args.block_size, cache_salt=salt), number=50, repeat=5)) / 50
        blocks_ = min(timeit.repeat(by_block, number=50, repeat=5)) / 50
        prompts[n] = {"hash_token_blocks_us": round(whole * 1e6, 1), "block_by_block_us": round(blocks_ * 1e6, 1),
                      "ratio": round(whole / blocks_, 3)}
        print(f"{n}-token prompt: hash_token_blocks {whole * 1e6:.1f} us, block by block {blocks_ * 1e6:.1f} us "
              f"({whole / blocks_:.2f}x)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"block_size": args.block_size, "blocks": args.blocks, "blocks_per_s": results, "prompt_us": prompts}, fh, indent=2)


if __name__ == "__main__":
    main()
