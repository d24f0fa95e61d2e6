import json

from unicache.cli.demo import build_workload


def test_demo_workload_is_deterministic_and_sessions_grow_by_whole_turns():
    a = build_workload(seed=3, sessions=2, turns=3, templated=4, single=2)
    b = build_workload(seed=3, sessions=2, turns=3, templated=4, single=2)
    assert [(r.kind, r.text, json.dumps(r.chat), r.session_id, r.wave) for r in a] == [
        (r.kind, r.text, json.dumps(r.chat), r.session_id, r.wave) for r in b
    ]
    assert [r.kind for r in a].count("session") == 6
    s0 = [r for r in a if r.session_id == "demo-3-0"]
    assert [r.wave for r in s0] == [0, 1, 2]
    # each turn's messages start with the whole previous turn's messages
    for prev, nxt in zip(s0, s0[1:]):
        assert nxt.chat[: len(prev.chat)] == prev.chat
        assert len(nxt.chat) == len(prev.chat) + 2
