"""The workload generator: seeded, labelled, sessions that chain, skewed templates."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

import pytest

from unicache.sim.workload import WorkloadConfig, generate

ONLY = dict(chat_rate=0.0, agent_rate=0.0, template_rate=0.0, plain_rate=0.0)


def gen(**kw) -> list[dict]:
    return generate(WorkloadConfig(**{**dict(duration=300.0), **kw}))


def test_same_seed_same_trace_other_seed_other_trace():
    assert gen(seed=3) == gen(seed=3)
    assert gen(seed=3) != gen(seed=4)


def test_records_are_valid_sorted_and_labelled():
    recs = gen(seed=1)
    ts = [r["timestamp"] for r in recs]
    assert ts == sorted(ts) and ts[-1] < 300_000
    assert {r["task"] for r in recs} == {"chat", "agent", "tool", "code", "qa", "math", "other"}
    for r in recs:
        assert r["input_length"] >= 1 and r["output_length"] >= 1
        assert -(-r["input_length"] // 16) == len(r["hash_ids"])
        assert set(r) >= {"tenant", "turn", "task", "template", "output_hash_ids"}
        assert r["template"] == (r["task"] in ("tool", "code"))
        assert ("session_id" in r) == (r["task"] in ("chat", "agent"))


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_session_turns_extend_prompt_plus_answer(kind):
    recs = gen(seed=2, **{**ONLY, f"{kind}_rate": 0.2}, duration=600.0)
    by_session: dict[str, list[dict]] = {}
    for r in recs:
        by_session.setdefault(r["session_id"], []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in by_session.values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:]):
            ctx = prev["hash_ids"] + prev["output_hash_ids"]
            assert cur["hash_ids"][: len(ctx)] == ctx
            assert len(cur["hash_ids"]) > len(ctx)
            assert cur["input_length"] % 16 == 0
            assert len(prev["output_hash_ids"]) == prev["output_length"] // 16


def test_agent_gaps_are_shorter_and_prompts_longer_than_chat():
    chat = gen(seed=5, **{**ONLY, "chat_rate": 0.3}, duration=1200.0)
    agent = gen(seed=5, **{**ONLY, "agent_rate": 0.3}, duration=1200.0)

    def median_gap(recs):
        last, gaps = {}, []
        for r in recs:
            s = r["session_id"]
            if s in last:
                gaps.append(r["timestamp"] - last[s])
            last[s] = r["timestamp"]
        return sorted(gaps)[len(gaps) // 2]

    assert median_gap(agent) * 5 < median_gap(chat)
    mean_len = lambda recs: sum(r["input_length"] for r in recs) / len(recs)  # noqa: E731
    assert mean_len(agent) > 2 * mean_len(chat)


def test_template_popularity_is_zipf_skewed():
    recs = gen(seed=7, **{**ONLY, "template_rate": 5.0}, tenants=1, templates=20, template_zipf=1.2)
    heads = Counter(tuple(r["hash_ids"][:2]) for r in recs)
    counts = [c for _, c in heads.most_common()]
    assert len(counts) == 20
    assert counts[0] > 4 * counts[-1]
    assert all(r["turn"] == 0 and r["template"] for r in recs)


def test_plain_requests_share_nothing():
    recs = gen(seed=9, **{**ONLY, "plain_rate": 2.0})
    ids = [h for r in recs for h in r["hash_ids"] + r["output_hash_ids"]]
    assert len(ids) == len(set(ids))
    assert not any(r["template"] for r in recs)


def test_every_knob_is_validated():
    with pytest.raises(ValueError, match="--duration"):
        WorkloadConfig(duration=0)
    with pytest.raises(ValueError, match="--chat-rate"):
        WorkloadConfig(chat_rate=-1)
    with pytest.raises(ValueError, match="--agent-turns-mean"):
        WorkloadConfig(agent_turns_mean=0.5)
    with pytest.raises(ValueError, match="--templates"):
        WorkloadConfig(templates=0)
    assert generate(WorkloadConfig(templates=0, template_rate=0.0, agent_prompts=0, agent_rate=0.0, duration=10.0))
    assert all("help" in f.metadata for f in fields(WorkloadConfig))
