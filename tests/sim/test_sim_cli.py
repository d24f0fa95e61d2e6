"""``unicache sim`` and ``unicache gen-workload`` end to end, including every usage error."""

from __future__ import annotations

import json

import pytest

from unicache.cli.main import main
from unicache.sim.trace import write_trace

REC = {"timestamp": 0, "input_length": 8, "output_length": 0, "hash_ids": [1, 2]}
TRACE = [
    REC,
    {**REC, "timestamp": 10_000, "input_length": 4, "hash_ids": [5]},
    {**REC, "timestamp": 20_000, "input_length": 4, "hash_ids": [6]},
    # NOTE: one token past [1, 2], so both blocks are reusable (the last token is computed)
    {**REC, "timestamp": 30_000, "input_length": 9, "hash_ids": [1, 2, 3]},
]


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, TRACE)
    return path


def sim(*args) -> int:
    return main(["sim", "--block-size", "4", "--no-progress", *map(str, args)])


def test_sim_writes_json_table_and_plot(trace_path, tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "hit.png"
    rc = sim("--trace", trace_path, "--capacity-blocks", "3,8", "--policies", "lru,opt", "--json", out, "--plot", png)
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["unique_blocks"], report["block_accesses"], report["requests"]) == (5, 7, 4)
    got = {(r["policy"], r["capacity_blocks"]): r["hit_blocks"] for r in report["results"]}
    # capacity 3: for [6] lru evicts block 2 of [1, 2] (released before [5]); opt evicts
    # [5] (never used again), so the last request hits both blocks
    assert got == {("lru", 3): 1, ("lru", 8): 2, ("opt", 3): 2, ("opt", 8): 2}
    first = report["results"][0]
    for key in ("policy", "capacity_blocks", "block_hit_ratio", "token_hit_ratio", "ttft_mean_s", "ttft_p99_s",
                "per_task", "evictions", "elapsed_s", "accesses_per_s"):
        assert key in first
    assert first["block_hit_ratio"] == pytest.approx(1 / 7)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith(f"trace {trace_path}: 4 requests, 5 unique blocks, 7 block accesses")
    assert stdout[1].split()[:3] == ["policy", "capacity", "cap%"]
    assert len(stdout) == 2 + 4


def test_sim_host_tier_grid(trace_path, tmp_path, capsys):
    """Host capacities are a grid axis; at 3 GPU blocks lru's victim, block 2 of [1, 2],
    waits in a 2-block host tier and the last request promotes it."""
    out = tmp_path / "out.json"
    rc = sim("--trace", trace_path, "--capacity-blocks", "3", "--host-capacity-blocks", "0,2", "--policies", "lru",
             "--host-eviction-policy", "lru", "--json", out)
    assert rc == 0
    rows = [(r["host_capacity_blocks"], r["host_policy"], r["hit_blocks"], r["host_hit_blocks"])
            for r in json.loads(out.read_text())["results"]]
    assert rows == [(0, None, 1, 0), (2, "lru", 2, 1)]
    assert capsys.readouterr().out.splitlines()[1].split()[:4] == ["policy", "capacity", "cap%", "host"]


def test_sim_capacity_fraction_and_replicas(trace_path, tmp_path):
    out = tmp_path / "out.json"
    rc = sim("--trace", trace_path, "--capacity-frac", "0.5", "--policies", "lru", "--replicas", "2",
             "--router", "round_robin", "--pooled", "--json", out)
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["router"], r["replicas"], r["capacity_blocks"]) for r in results] == [
        ("round_robin", 2, 2), ("pooled", 2, 2)]
    assert all("load_imbalance" in r for r in results)
    assert all(r["capacity_frac"] == 0.5 for r in results)


def test_ignore_labels_reports_classifier_accuracy(tmp_path):
    path, out = tmp_path / "l.jsonl", tmp_path / "o.json"
    write_trace(path, [
        {**REC, "hash_ids": [1, 2], "output_hash_ids": [3], "output_length": 4, "session_id": "s", "turn": 0, "task": "chat"},
        {**REC, "timestamp": 60_000, "input_length": 20, "hash_ids": [1, 2, 3, 4, 5], "session_id": "s", "turn": 1, "task": "chat"},
        {**REC, "timestamp": 61_000, "hash_ids": [7, 8], "turn": 0, "task": "qa", "template": False},
    ])
    assert sim("--trace", path, "--capacity-blocks", "16", "--policies", "lru", "--ignore-labels", "--json", out) == 0
    report = json.loads(out.read_text())
    acc = report["classifier_accuracy"]
    # turn 0 of the session cannot be known to be a session yet; the rest agrees
    assert acc["labelled_requests"] == 3
    assert acc["session"] == pytest.approx(2 / 3)
    assert acc["turn"] == 1.0 and acc["template"] == 1.0
    assert report["results"][0]["hit_blocks"] == 3


def _bad_line(tmp_path, line: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(REC) + "\n" + line + "\n")
    return path


@pytest.mark.parametrize(
    "make_args, expected",
    [
        (lambda p, t: ["--trace", _bad_line(t, "{oops")], ":2: invalid JSON"),
        (lambda p, t: ["--trace", _bad_line(t, json.dumps({k: v for k, v in REC.items() if k != "hash_ids"}))], ":2: field 'hash_ids' is missing"),
        (lambda p, t: ["--trace", _bad_line(t, json.dumps({**REC, "output_length": -5}))], ":2: field 'output_length' must be >= 0"),
        (lambda p, t: ["--trace", t / "missing.jsonl"], "missing.jsonl:0: cannot open"),
        (lambda p, t: ["--trace", p, "--policies", "lru,nope"], "--policies: unknown policy 'nope'"),
        (lambda p, t: ["--trace", p, "--replicas", "2", "--router", "nope"], "--router: unknown router 'nope'"),
        (lambda p, t: ["--trace", p, "--capacity-blocks", "0"], "--capacity-blocks: capacity must be positive, got 0"),
        (lambda p, t: ["--trace", p, "--capacity-frac", "0"], "--capacity-frac: capacity must be positive, got 0"),
        (lambda p, t: ["--trace", p, "--capacity-frac", "0.01"], "--capacity-frac: capacity 0.01 of 5 unique blocks is 0 blocks"),
        (lambda p, t: ["--trace", p, "--capacity-blocks", "x"], "--capacity-blocks: 'x' is not a number"),
        (lambda p, t: ["--trace", p, "--block-size", "0"], "--block-size must be positive"),
        (lambda p, t: ["--trace", p, "--index-flush-s", "-0.05"], "--index-flush-s must not be negative, got -0.05"),
        (lambda p, t: ["--trace", p, "--step-token-budget", "0"], "--step-token-budget must be positive, got 0"),
        (lambda p, t: ["--trace", p, "--service", "steps", "--host-capacity-blocks", "4"], "--service steps has no host tier"),
        (lambda p, t: ["--trace", p, "--host-capacity-blocks", "-1"], "--host-capacity-blocks: blocks must not be negative, got -1"),
        (lambda p, t: ["--trace", p, "--host-eviction-policy", "nope"], "--host-eviction-policy: unknown policy 'nope'"),
        (lambda p, t: ["--trace", p, "--model-preset", "gpt-9"], "unknown model preset 'gpt-9'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(trace_path, tmp_path, capsys, make_args, expected):
    rc = sim(*make_args(trace_path, tmp_path))
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("unicache sim: error: ")
    assert expected in err


def test_gen_workload_then_sim(tmp_path, capsys):
    path = tmp_path / "mix.jsonl"
    assert main(["gen-workload", "--seed", "4", "--duration", "60", "--plain-rate", "0.5", "--out", str(path)]) == 0
    line = capsys.readouterr().out.strip()
    n = len(path.read_text().splitlines())
    assert line.startswith(f"wrote {n} requests (") and line.endswith(f"to {path}")
    assert main(["sim", "--trace", str(path), "--capacity-frac", "0.1", "--policies", "lru,radix-lru,opt", "--no-progress"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    hit = {row.split()[0]: float(row.split()[3]) for row in rows}
    assert hit["opt"] >= hit["lru"]


def test_gen_workload_bad_knob(tmp_path, capsys):
    assert main(["gen-workload", "--duration", "-1", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr().err == "unicache gen-workload: error: --duration must be positive, got -1.0\n"


# Four 8-token requests (2 blocks each, nothing shared) one second apart; one lane, one
# request per batch, prefill 0.125 s per uncached token, no decode: alone each takes 1 s.
RATE_TRACE = [{"timestamp": 1000 * i, "input_length": 8, "output_length": 0, "hash_ids": [10 * i, 10 * i + 1]}
              for i in range(4)]
LINEAR_FLAGS = ["--prefill-coef", "0.125", "--batch-exp", "1", "--token-exp", "1", "--decode-s-per-token", "0",
                "--lanes", "1", "--max-batch-requests", "1", "--capacity-blocks", "64", "--policies", "lru"]


def _rate_run(tmp_path, *extra):
    path, out = tmp_path / "rate.jsonl", tmp_path / "rate.json"
    write_trace(path, RATE_TRACE)
    assert sim("--trace", path, *LINEAR_FLAGS, "--json", out, *extra) == 0
    return json.loads(out.read_text())


def test_rate_scale_divides_arrival_times_and_reports_ttft_percentiles(tmp_path, capsys):
    png = tmp_path / "ttft.png"
    report = _rate_run(tmp_path, "--rate-scale", "0.5,1,2,4", "--goodput-slo-s", "auto", "--plot-ttft", png)
    got = [(r["rate_scale"], r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p99_s"], r["ttft_mean_s"]) for r in report["results"]]
    # x2: arrivals 0, .5, 1, 1.5 -> first tokens at 1, 2, 3, 4 (TTFT 1, 1.5, 2, 2.5);
    # x4: arrivals 0, .25, .5, .75 -> TTFT 1, 1.75, 2.5, 3.25 (nearest-rank percentiles)
    assert got == [
        (0.5, 1.0, 1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0, 1.0),
        (2.0, 1.5, 2.5, 2.5, 1.75),
        (4.0, 1.75, 3.25, 3.25, 2.125),
    ]
    # SLO = 3 x the unloaded TTFT of the median (8-token) request = 3 x 1 s; p90 crosses
    # 3 s between x2 (2.5) and x4 (3.25): 2/3 of the way in log scale -> 2 ** (5/3)
    assert report["unloaded_median_ttft_s"] == pytest.approx(1.0)
    assert report["goodput_slo_s"] == pytest.approx(3.0)
    assert report["goodput"] == [{"policy": "lru", "capacity_blocks": 64, "goodput_rate_scale": pytest.approx(2 ** (5 / 3)),
                                  "goodput_saturated": False, "slo_s": pytest.approx(3.0)}]
    assert [r["goodput_rate_scale"] for r in report["results"]] == [pytest.approx(2 ** (5 / 3))] * 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "goodput lru @ 64 blocks: rate scale 3.175 (TTFT p90 SLO 3.0000 s)" in out


@pytest.mark.parametrize("slo, expected, saturated", [("2.5", 2.0, False), ("0.5", 0.0, False), ("10", 4.0, True)])
def test_goodput_edges_exact_pass_first_fails_all_pass(tmp_path, slo, expected, saturated):
    report = _rate_run(tmp_path, "--rate-scale", "4,1,2", "--goodput-slo-s", slo)
    assert [r["rate_scale"] for r in report["results"]] == [4.0, 1.0, 2.0]  # the order given
    (g,) = report["goodput"]
    assert (g["goodput_rate_scale"], g["goodput_saturated"]) == (expected, saturated)


def test_goodput_per_router_with_replicas(tmp_path):
    report = _rate_run(tmp_path, "--replicas", "2", "--router", "round_robin,least_loaded", "--rate-scale", "1,4",
                       "--goodput-slo-s", "1.2")
    rows = [(r["router"], r["rate_scale"], r["ttft_p90_s"]) for r in report["results"]]
    # x4 on two replicas: requests 2 and 3 wait 0.5 s behind 0 and 1 (TTFT 1.5)
    assert rows == [("round_robin", 1.0, 1.0), ("round_robin", 4.0, 1.5),
                    ("least_loaded", 1.0, 1.0), ("least_loaded", 4.0, 1.5)]
    got = [(g["router"], round(g["goodput_rate_scale"], 6)) for g in report["goodput"]]
    # p90 1.0 -> 1.5 crosses 1.2 at 0.4 of log(1)..log(4): 4 ** 0.4
    assert got == [("round_robin", round(4 ** 0.4, 6)), ("least_loaded", round(4 ** 0.4, 6))]


@pytest.mark.parametrize("flags, expected", [
    (["--rate-scale", "0"], "--rate-scale: rate scale must be positive, got 0"),
    (["--rate-scale", "1,x"], "--rate-scale: 'x' is not a number"),
    (["--rate-scale", "1,1"], "--rate-scale: repeated value in '1,1'"),
    (["--goodput-slo-s", "-1"], "--goodput-slo-s: SLO must be positive, got -1"),
    (["--goodput-slo-s", "1,2"], "--goodput-slo-s: one value (seconds) or 'auto'"),
])
def test_rate_and_slo_usage_errors(trace_path, capsys, flags, expected):
    assert sim("--trace", trace_path, *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


def test_index_flush_reaches_every_routed_replay(tmp_path):
    report = _rate_run(tmp_path, "--replicas", "2", "--router", "cache_aware", "--pooled", "--index-flush-s", "0.05")
    assert [(r["router"], r["index_flush_s"]) for r in report["results"]] == [("cache_aware", 0.05), ("pooled", 0.0)]


def test_step_service_replays_the_rate_trace(tmp_path):
    """Four 8-token requests a second apart, one lane, no decode: alone each takes 1 s on
    either model. At x4 (arrivals 0, .25, .5, .75) the first prefills alone [0, 1] and the
    three that arrived meanwhile share the next step (24 tokens: 3 s), whatever
    --max-batch-requests says (a step's only bound is its token budget)."""
    report = _rate_run(tmp_path, "--service", "steps", "--rate-scale", "1,4", "--goodput-slo-s", "auto")
    got = [(r["rate_scale"], r["ttft_p50_s"], r["ttft_p99_s"]) for r in report["results"]]
    assert report["service"] == "steps"
    assert got == [(1.0, 1.0, 1.0), (4.0, 3.25, 3.75)]
    # no decode: the light-load SLO is 3 x the idle TTFT, 3 s; p90 3.25 at x4 fails
    assert report["goodput_slo_s"] == 3.0


def test_sim_prices_and_times_with_a_calibration(trace_path, tmp_path, capsys):
    """``--calibration`` (what the router's /v1/cluster/costs returns): the replicas'
    timing is its mean fitted line, and a bad file is one line naming the flag."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"version": 1, "backends": {
        "a": {"prefill_base_s": 0.01, "prefill_per_token_s": 0.001, "per_outstanding_s": 0.05,
              "decode_base_s": 0.02, "decode_per_seq_s": 0.0},
        "b": {"prefill_base_s": 0.03, "prefill_per_token_s": 0.003, "per_outstanding_s": 0.05,
              "decode_base_s": 0.02, "decode_per_seq_s": 0.0}}}))
    out = tmp_path / "out.json"
    assert sim("--trace", trace_path, "--capacity-blocks", "8", "--policies", "lru", "--replicas", "2",
               "--router", "cache_aware", "--calibration", cal, "--json", out) == 0
    report = json.loads(out.read_text())
    assert (report["timing"]["prefill_base_s"], report["timing"]["prefill_per_token_s"]) == (0.02, 0.002)
    assert report["timing"]["decode_s_per_token"] == 0.02
    capsys.readouterr()
    cal.write_text("{}")
    assert sim("--trace", trace_path, "--capacity-blocks", "8", "--calibration", cal) == 2
    assert capsys.readouterr().err == (
        'unicache sim: error: --calibration: a calibration is a JSON object with "version": 1 and "backends"\n')
