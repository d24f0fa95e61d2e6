"""bench/live_ab.py, the live A/B of routers in front of one vLLM fleet (issue 36).

The tiny run: 2 servers per fleet, 30 requests, arms ``ours`` (cache_aware, UniCache inside
vLLM) and ``round-robin`` (vLLM's own order). The sequence is prefix-heavy and spaced out,
so its outcome does not hang on timing: three 256-token documents asked about in turn, ten
times each, each question a new 32-token suffix, one request every 0.4 s. Each server's
pool holds 25 blocks: two documents and their recent suffixes, not three. Cache-aware
routing keeps each document on one server, so after the first three requests every
prompt finds its document cached (27 x 256 of 30 x 288 prompt tokens: 0.800); round robin
sends every document to both servers, each computes it again, and each server cycles
through all three documents. The simulator, replaying the same blocks, predicts both.

Peers are never installed here: asking for one is refused with one line that says how
to install it.
"""

from __future__ import annotations

import json

import pytest

from bench import live_ab
from bench.live_ab_arms import ARMS

RATE_FIELDS = {"rate_scale", "hit_ratio", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "goodput",
               "router_cpu_ms_per_request", "requests", "failed", "router_overdue_share"}
ARM_FIELDS = (RATE_FIELDS - {"rate_scale"}) | {"rates"}


def prefix_heavy_trace(path) -> None:
    with open(path, "w") as f:
        for i in range(30):
            doc = i % 3
            f.write(json.dumps({"timestamp": i * 400, "input_length": 9 * 16, "output_length": 8,
                                "hash_ids": [doc * 100 + j for j in range(8)] + [1000 + i]}) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_live_ab_ranks_cache_aware_with_unicache_above_round_robin(tmp_path, capsys):
    trace, out = tmp_path / "prefix.jsonl", tmp_path / "res" / "live_ab.json"
    prefix_heavy_trace(trace)
    # one round (the default is 3) keeps CI short; this sequence's hit ratios do not hang on timing
    rc = live_ab.main(["--trace", str(trace), "--servers", "2", "--arms", "ours,round-robin", "--rates", "1",
                       "--rounds", "1", "--pool-frac", "0.45", "--json", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    arms = rep["arms"]
    assert set(arms) == {"ours", "round-robin"}
    for a in arms.values():
        assert ARM_FIELDS <= set(a) and len(a["rates"]) == 1 and RATE_FIELDS <= set(a["rates"][0])
        assert a["requests"] == 30 and a["failed"] == 0 and a["rates"][0]["errors"] == []
        assert all(a[k] is not None for k in ARM_FIELDS)
    assert rep["pool_blocks"] == 25 and rep["unique_blocks"] == 54
    # Every document computed once (3 of 30 prompts miss it): 27 x 256 / (30 x 288).
    assert arms["ours"]["hit_ratio"] == pytest.approx(0.8, abs=0.02)
    assert arms["ours"]["hit_ratio"] > arms["round-robin"]["hit_ratio"] + 0.15
    # The simulator replays the same blocks: the same ordering, ours to the exact figure.
    sim = rep["sim"]["arms"]
    assert sim["ours"]["rates"][0]["hit_ratio"] == pytest.approx(0.8, abs=0.005)
    assert sim["ours"]["rates"][0]["hit_ratio"] > sim["round-robin"]["rates"][0]["hit_ratio"]
    # every compared figure has its interval, and ours' hit ratio is set apart from round robin's
    for a in arms.values():
        lo, hi = a["hit_ratio_ci"]
        assert lo <= hi and a["ttft_p50_ci_s"][0] <= a["ttft_p50_ci_s"][1]
    assert rep["verdicts"]["round-robin"][0]["hit_ratio"] == "better"
    assert rep["regime"] == "decode-heavy" and (rep["tokens_per_id"], rep["max_output_tokens"]) == (32, 16)
    assert out.with_suffix(".md").read_text().count("| ours |") == 3 and out.with_suffix(".png").stat().st_size > 0


def test_a_missing_peer_is_refused_with_one_line_that_says_how_to_install_it(tmp_path, capsys):
    rc = live_ab.main(["--trace", "unused.jsonl", "--arms", "ours,sglang-router", "--peer-venv", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1
    assert err.strip() == (f"live_ab: arm sglang-router needs sglang-router==0.3.2 in {tmp_path / 'none'}, which does not "
                           "have it; install it with: python -m bench.live_ab --install-peers sglang-router")


def test_every_peer_arm_sees_vllms_own_order_and_has_no_sim_twin():
    assert {a.name for a in ARMS.values() if a.peer} == {"vllm-router", "sglang-router", "smg", "vllm-router-rr"}
    assert all(a.eviction is None and a.sim is None for a in ARMS.values() if a.peer)
    # a peer's policy is its --policy: cache_aware unless the arm names another
    assert {a.name: a.policy for a in ARMS.values() if a.peer} == {
        "vllm-router": None, "sglang-router": None, "smg": None, "vllm-router-rr": "round_robin"}
    assert [a.name for a in ARMS.values() if a.eviction == "unicache"] == ["ours"]


async def test_the_client_sends_the_traces_labels_as_the_simulator_gets_them(tmp_path):
    """Session, task and template go as headers (what the simulator's copy of the trace
    keeps), so our router need not infer a task from replayed, time-compressed gaps."""
    import httpx

    from bench.live_ab_client import send
    from bench.live_ab_workload import build_requests
    from unicache.sim.trace import read_trace

    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [1, 2], "session_id": "s-1", "turn": 0,
             "task": "chat", "tenant": "t1"},
            {"timestamp": 5, "input_length": 32, "output_length": 4, "hash_ids": [3, 4], "template": True},
            {"timestamp": 9, "input_length": 32, "output_length": 4, "hash_ids": [5, 6]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({k: v for k, v in request.headers.items() if k.startswith("x-")})
        return httpx.Response(200, text='data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        for req in build_requests(read_trace(str(trace)), ["w"], 16, 4):
            out = await send(client, "http://router", "m", req, "k", 5.0)
            assert out.error is None and out.tokens == 1
    assert seen == [{"x-session-id": "s-1", "x-unicache-task": "chat"}, {"x-unicache-template": "true"}, {}]
