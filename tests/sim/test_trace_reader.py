"""Every TraceError the trace reader raises names the file, the line and the field."""

from __future__ import annotations

import json

import pytest

from unicache.contract.request_class import Task
from unicache.sim.trace import TraceError, iter_trace, read_trace, write_trace

GOOD = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}


def with_(**changes) -> str:
    rec = dict(GOOD)
    for k, v in changes.items():
        if v is _DROP:
            rec.pop(k)
        else:
            rec[k] = v
    return json.dumps(rec)


_DROP = object()

CASES = [
    ("{not json", None, "invalid JSON"),
    ("[1, 2]", None, "must be a JSON object"),
    (with_(timestamp=_DROP), "timestamp", "is missing"),
    (with_(timestamp=-1), "timestamp", "non-negative number"),
    (with_(timestamp="5"), "timestamp", "non-negative number"),
    (with_(timestamp=True), "timestamp", "non-negative number"),
    (with_(input_length=_DROP), "input_length", "is missing"),
    (with_(input_length=0), "input_length", "must be >= 1"),
    (with_(input_length=-3), "input_length", "must be >= 1"),
    (with_(input_length=2.5), "input_length", "must be an integer"),
    (with_(input_length="10"), "input_length", "must be an integer"),
    (with_(input_length=True), "input_length", "must be an integer"),
    (with_(output_length=_DROP), "output_length", "is missing"),
    (with_(output_length=-1), "output_length", "must be >= 0"),
    (with_(hash_ids=_DROP), "hash_ids", "is missing"),
    (with_(hash_ids=[]), "hash_ids", "must not be empty"),
    (with_(hash_ids="1,2"), "hash_ids", "list of integers"),
    (with_(hash_ids=[1, "2"]), "hash_ids", "list of integers"),
    (with_(hash_ids=[1, True]), "hash_ids", "list of integers"),
    (with_(output_hash_ids=[1.5]), "output_hash_ids", "list of integers"),
    (with_(turn=-1), "turn", "must be >= 0"),
    (with_(turn="x"), "turn", "must be an integer"),
    (with_(task="poetry"), "task", "unknown task 'poetry'"),
    (with_(template="yes"), "template", "must be true or false"),
    (with_(session_id=[1]), "session_id", "string or integer"),
    (with_(tenant=7), "tenant", "must be a string"),
]


@pytest.mark.parametrize("line, field, reason", CASES)
def test_bad_line_names_file_line_and_field(tmp_path, line, field, reason):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    e = err.value
    assert (e.path, e.line, e.field) == (str(path), 3, field)  # blank line 2 still counts
    msg = str(e)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:3:")
    assert reason in msg
    if field:
        assert f"field '{field}'" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(TraceError) as err:
        list(iter_trace(path))
    assert (err.value.line, err.value.field) == (0, None)
    assert str(err.value) == f"{path}:0: cannot open (No such file or directory)"


def test_empty_trace(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(TraceError, match="trace is empty"):
        read_trace(path)


def test_round_trip_sorted_stably_with_labels(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [
        {**GOOD, "timestamp": 5, "hash_ids": [1]},
        {**GOOD, "timestamp": 1.5, "hash_ids": [2], "session_id": 7, "turn": 1, "task": "agent", "tenant": "a", "template": False},
        {**GOOD, "timestamp": 5, "hash_ids": [3], "output_hash_ids": [4, 5]},
    ])
    reqs = read_trace(path)
    assert [r.hash_ids for r in reqs] == [[2], [1], [3]]
    assert [r.index for r in reqs] == [0, 1, 2]
    first = reqs[0]
    assert (first.session_id, first.turn, first.task, first.tenant, first.template) == ("7", 1, Task.AGENT, "a", False)
    assert first.labelled and not reqs[1].labelled
    assert reqs[2].output_hash_ids == [4, 5]
    assert reqs[1].timestamp_ms == 5.0 and reqs[1].turn is None
