"""``unicache sim`` and ``unicache gen-workload`` end to end, including every usage error."""

from __future__ import annotations

import json

import pytest

from unicache.cli import main
from unicache.trace import write_trace

REC = {"timestamp": 0, "input_length": 8, "output_length": 0, "hash_ids": [1, 2]}
TRACE = [
    REC,
    {**REC, "timestamp": 10_000, "input_length": 4, "hash_ids": [5]},
    {**REC, "timestamp": 20_000, "input_length": 4, "hash_ids": [6]},
    {**REC, "timestamp": 30_000, "input_length": 8, "hash_ids": [1, 2]},
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
    assert (report["unique_blocks"], report["block_accesses"], report["requests"]) == (4, 6, 4)
    got = {(r["policy"], r["capacity_blocks"]): r["hit_blocks"] for r in report["results"]}
    # capacity 3: for [6] lru evicts block 2 of [1, 2] (released before [5]); opt evicts
    # [5] (never used again), so the last request hits both blocks
    assert got == {("lru", 3): 1, ("lru", 8): 2, ("opt", 3): 2, ("opt", 8): 2}
    first = report["results"][0]
    for key in ("policy", "capacity_blocks", "block_hit_ratio", "token_hit_ratio", "ttft_mean_s", "ttft_p99_s",
                "per_task", "evictions", "elapsed_s", "accesses_per_s"):
        assert key in first
    assert first["block_hit_ratio"] == pytest.approx(1 / 6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith(f"trace {trace_path}: 4 requests, 4 unique blocks, 6 block accesses")
    assert stdout[1].split()[:3] == ["policy", "capacity", "cap%"]
    assert len(stdout) == 2 + 4


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
        (lambda p, t: ["--trace", p, "--policies", "lru,fifo"], "--policies: unknown policy 'fifo'"),
        (lambda p, t: ["--trace", p, "--replicas", "2", "--router", "nope"], "--router: unknown router 'nope'"),
        (lambda p, t: ["--trace", p, "--capacity-blocks", "0"], "--capacity-blocks: capacity must be positive, got 0"),
        (lambda p, t: ["--trace", p, "--capacity-frac", "0"], "--capacity-frac: capacity must be positive, got 0"),
        (lambda p, t: ["--trace", p, "--capacity-frac", "0.01"], "--capacity-frac: capacity 0.01 of 4 unique blocks is 0 blocks"),
        (lambda p, t: ["--trace", p, "--capacity-blocks", "x"], "--capacity-blocks: 'x' is not a number"),
        (lambda p, t: ["--trace", p, "--block-size", "0"], "--block-size must be positive"),
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
