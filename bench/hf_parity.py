"""Built-in engine vs transformers on tiny checkpoints transformers wrote: logit gaps and refusals.

For every case of ``unicache.testing.hf_models.CASES`` (seeded random weights, float32,
CPU): the largest |logit difference| against transformers over a prompt plus its greedy
continuation, on our dense forward and on the paged serving path (prefix, cached suffix,
then one decode step per token); whether the engine's greedy tokens equal transformers';
and, for scaled rope types, the gap had the rope been read as plain rope (what the
engine did before it read ``rope_scaling``). Then the one-line refusal for each
unsupported config of ``REFUSED``.

Run: .venv/bin/python -m bench.hf_parity [--prompt-len 40] [--new-tokens 24] [--out-dir bench/results]
Needs transformers (the ``dev`` extra).
"""

from __future__ import annotations

from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait  # noqa: E402 - before torch

prefer_passive_omp_wait()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from unicache.replica.engines.api import EngineRequest, SamplingParams  # noqa: E402
from unicache.replica.engines.builtin.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from unicache.replica.engines.builtin.config import EngineConfig  # noqa: E402
from unicache.replica.engines.builtin.engine import LLMEngine  # noqa: E402
from unicache.replica.engines.builtin.model import Rotary  # noqa: E402
from bench.paths import RESULTS  # noqa: E402
from bench.report_files import write_report  # noqa: E402
from unicache.testing.hf_models import (  # noqa: E402
    CASES, REFUSED, edit_config, hf_greedy, hf_logits, load_hf, paged_logits, prompt, write_case,
)

BLOCK = 4


def _engine_tokens(path: str, ids: list[int], n: int, **cfg) -> list[int]:
    engine = LLMEngine(EngineConfig(checkpoint=path, block_size=BLOCK, num_blocks=128, device="cpu", eviction_policy="lru", **cfg))
    engine.add_request(EngineRequest("a", list(ids), SamplingParams(max_tokens=n, ignore_eos=True)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def measure_case(name: str, root: str, prompt_len: int, new_tokens: int) -> dict:
    path = write_case(name, f"{root}/{name}")
    hf, ours = load_hf(path), load_checkpoint(path)
    ids = prompt(prompt_len)
    want_tokens = hf_greedy(hf, ids, new_tokens)
    full = ids + want_tokens
    want = hf_logits(hf, full)
    dense = ours.forward_dense(torch.tensor(full))
    split = prompt_len * 3 // 4
    chunks = [(full, 0, split), (full, split, prompt_len)] + [(full, p, p + 1) for p in range(prompt_len, len(full))]
    paged = paged_logits(ours, chunks, BLOCK)
    got_tokens = _engine_tokens(path, ids, new_tokens)
    row = {
        "case": name,
        "model_type": ours.config.architecture,
        "rope_type": ours.config.rope.rope_type,
        "max_abs_logit_diff_dense": float((dense - want).abs().max()),
        "max_abs_logit_diff_paged": float((paged - want).abs().max()),
        "logit_std": float(want.std()),
        "greedy_tokens_equal": got_tokens == want_tokens,
        "greedy_tokens": len(want_tokens),
        "diff_if_read_as_default_rope": None,
    }
    if ours.config.rope.rope_type != "default":
        ours.config.rope = dataclasses.replace(ours.config.rope, rope_type="default")
        ours.rotary = Rotary(ours.config)
        row["diff_if_read_as_default_rope"] = float((ours.forward_dense(torch.tensor(full)) - want).abs().max())
    return row


def refusals(root: str) -> list[dict]:
    base = write_case("llama-default", f"{root}/refusal-base")
    rows = []
    for key, (edit, expected) in sorted(REFUSED.items()):
        path = shutil.copytree(base, f"{root}/refused-{key}")
        edit_config(path, edit)
        try:
            LLMEngine(EngineConfig(checkpoint=path, block_size=BLOCK, num_blocks=16, device="cpu", eviction_policy="lru"))
            message = None
        except CheckpointError as exc:
            message = str(exc)
        rows.append({"case": key, "message": message, "as_expected": bool(message and message.startswith(expected))})
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# Built-in engine vs transformers",
        "",
        f"Command: `{report['command']}` (transformers {report['transformers']}, torch {report['torch']}, float32, CPU).",
        f"Prompt {report['prompt_len']} tokens + {report['new_tokens']} greedy tokens; logits over all of them.",
        "",
        "| case | model_type | rope | max abs logit diff (dense) | (paged serving path) | greedy tokens equal | diff if rope read as default |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        wrong = "-" if r["diff_if_read_as_default_rope"] is None else f"{r['diff_if_read_as_default_rope']:.2f}"
        lines.append(
            f"| {r['case']} | {r['model_type']} | {r['rope_type']} | {r['max_abs_logit_diff_dense']:.1e} | "
            f"{r['max_abs_logit_diff_paged']:.1e} | {r['greedy_tokens_equal']} ({r['greedy_tokens']}) | {wrong} |"
        )
    lines += ["", f"Logit standard deviation across cases: {min(r['logit_std'] for r in report['cases']):.2f}-"
              f"{max(r['logit_std'] for r in report['cases']):.2f}.", "", "## Refused at load", "",
              "| config.json edit | engine's message |", "|---|---|"]
    for r in report["refusals"]:
        lines.append(f"| {r['case']} | {(r['message'] or 'NOT REFUSED').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        cases = [measure_case(name, root, args.prompt_len, args.new_tokens) for name in CASES]
        refused = refusals(root)
    report = {
        "command": "python -m bench.hf_parity" + (f" --prompt-len {args.prompt_len}" if args.prompt_len != 40 else "")
        + (f" --new-tokens {args.new_tokens}" if args.new_tokens != 24 else ""),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "cases": cases,
        "refusals": refused,
    }
    write_report(args.out_dir, "hf_parity", report, markdown(report))


if __name__ == "__main__":
    main()
