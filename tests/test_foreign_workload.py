"""The second workload generator (``bench.foreign_workload``) and its study's plumbing:
seeded, valid trace lines, the session and swarm structure it promises, labels a client
would send and nothing more, and the routing report's job runner replaying its traces."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from bench.foreign_workload import SOURCES, draw_knobs, generate_foreign
from bench.routing_report import Job, run_job
from bench.studies.foreign_traffic import foreign_trace, load_foreign, overall
from unicache.trace import read_trace, write_trace


def test_same_seed_same_trace_and_another_seed_another():
    assert generate_foreign(3, duration=60) == generate_foreign(3, duration=60)
    assert generate_foreign(3, duration=60) != generate_foreign(4, duration=60)
    assert draw_knobs(3) == draw_knobs(3)


@pytest.mark.parametrize("seed", range(6))
def test_shares_sum_to_one_and_the_family_is_the_largest(seed):
    k = draw_knobs(seed)
    assert math.isclose(sum(k.shares.values()), 1.0)
    assert set(k.shares) == set(SOURCES)
    assert k.shares[k.dominant] == max(k.shares.values())
    assert foreign_trace(seed).family == f"foreign-{k.dominant}"


@pytest.mark.parametrize("seed", range(4))
def test_records_are_sorted_whole_block_trace_lines_with_client_labels_only(seed, tmp_path):
    recs = generate_foreign(seed, duration=120, block_size=16)
    assert recs and [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)
    for r in recs:
        assert r["input_length"] == 16 * len(r["hash_ids"])
        assert len(r["output_hash_ids"]) == r["output_length"] // 16
        assert set(r) - {"timestamp", "input_length", "output_length", "hash_ids", "output_hash_ids"} \
            <= {"tenant", "session_id", "turn"}
        assert ("session_id" in r) == ("turn" in r)
    path = tmp_path / "t.jsonl"
    write_trace(path, recs)
    back = read_trace(path)
    assert [b.hash_ids for b in back] == [r["hash_ids"] for r in recs]
    assert all(b.task is None and b.template is None for b in back)


def _sessions(recs):
    by = defaultdict(list)
    for r in recs:
        if "session_id" in r:
            by[r["session_id"]].append(r)
    return by


def test_a_chat_turn_continues_resends_or_edits_its_conversation():
    """Every later turn of a chat session: the previous prompt again (regenerate), the
    previous prompt and answer plus a new message (continue), or an earlier point of the
    conversation plus a new message (edit: an earlier turn's prompt and answer, or the
    system prompt alone); a new message is blocks the session never read before."""
    recs = generate_foreign(15, duration=300)  # chat 44%, long sessions, edits and regenerations
    chats = {s: rs for s, rs in _sessions(recs).items() if s.startswith("chat-")}
    assert sum(len(rs) > 2 for rs in chats.values()) >= 10
    counts = {"regenerate": 0, "continue": 0, "edit": 0}
    for rs in chats.values():
        assert [r["turn"] for r in rs] == list(range(len(rs)))
        assert len({r["tenant"] for r in rs}) == 1
        for i in range(1, len(rs)):
            cur = rs[i]["hash_ids"]
            if cur == rs[i - 1]["hash_ids"]:
                counts["regenerate"] += 1
                continue
            seen = max(max(r["hash_ids"] + r["output_hash_ids"]) for r in rs[:i])
            bases = [rs[j]["hash_ids"] + rs[j]["output_hash_ids"] for j in range(i)]
            kept = max((len(b) for b in bases if cur[: len(b)] == b), default=0)
            if kept == len(bases[-1]) and cur[:kept] == bases[-1]:
                counts["continue"] += 1
            else:
                counts["edit"] += 1
                if not kept:  # back to the system prompt: the part turn 0 shares with it
                    while kept < len(cur) and cur[kept] == rs[0]["hash_ids"][kept]:
                        kept += 1
                    assert kept
            assert kept < len(cur) and min(cur[kept:]) > seen
    assert min(counts.values()) > 0, counts


def test_a_swarms_sub_agents_share_the_parents_context_and_grow_their_own():
    recs = generate_foreign(7, duration=300)  # swarm-dominated
    swarms = defaultdict(list)
    for sid, rs in _sessions(recs).items():
        if sid.startswith("swarm-"):
            swarms[sid.rsplit("-", 1)[0]].append(rs)
            for a, b in zip(rs, rs[1:]):  # a tool turn: the previous prompt, its answer, the tool's output
                prev = a["hash_ids"] + a["output_hash_ids"]
                assert b["hash_ids"][: len(prev)] == prev and len(b["hash_ids"]) > len(prev)
    fanned = [agents for agents in swarms.values() if len(agents) > 1]
    assert fanned
    for agents in fanned:
        firsts = [rs[0]["hash_ids"] for rs in agents]
        shared = 0
        while all(len(f) > shared and f[shared] == firsts[0][shared] for f in firsts):
            shared += 1
        assert 0 < shared < min(map(len, firsts))  # the parent's context, then each one's own task


def test_the_report_job_runner_replays_a_foreign_trace_through_its_loader():
    args = {"duration": 40.0, "requests_per_s": 1.5, "capacity_frac": 0.02, "u_ref": 0.5}
    st = foreign_trace(5)
    prepared = load_foreign(st, args)
    assert len(prepared.requests) == len(generate_foreign(5, duration=40.0))
    out = run_job(Job(st, (2,), (("rr", "round_robin", "lru"),), {}, args, loader=load_foreign))
    assert out["family"] == st.family and out["requests"] == len(prepared.requests)
    row = out["by_replicas"]["2"]["rows"]["rr"]
    assert row["goodput_u"] >= 0 and row["at_u_ref"]["u"] == 0.5


def test_overall_is_the_geometric_mean_of_paired_ratios_with_counts():
    def res(ours, su, sl, pooled):
        rows = {"o": ours, "sglang+unicache": su, "sglang+lru": sl, "pooled+unicache": pooled}
        return {"by_replicas": {"4": {"rows": {k: {"goodput_u": v} for k, v in rows.items()}}}}

    out = overall([res(2.0, 1.0, 1.0, 4.0), res(1.0, 2.0, 1.0, 1.0), res(0.0, 1.0, 1.0, 1.0)], "o", "4")
    su = out["sglang+unicache"]
    # ratios 2, 1/2 and (1/32) / 1 (goodput floored at 1/32)
    assert su["goodput_ratio"] == pytest.approx((2 * 0.5 / 32) ** (1 / 3))
    assert (su["above"], su["below"]) == (1, 2)
    assert su["ci95"][0] <= su["goodput_ratio"] <= su["ci95"][1]
    assert (out["sglang+lru"]["above"], out["sglang+lru"]["below"]) == (1, 1)


@pytest.mark.parametrize("fallback", [False, True])
def test_the_p90_slo_rule_applies_only_where_asked_and_the_median_rule_is_out_of_reach(fallback):
    args = {"duration": 60.0, "requests_per_s": 1.5, "capacity_frac": 0.02, "u_ref": 0.5,
            "slo_p90_fallback": fallback}
    cfgs = (("rr", "round_robin", "lru"),)
    wide = run_job(Job(foreign_trace(2), (2,), cfgs, {}, args, loader=load_foreign))  # p90 request > 3 x median
    assert wide["unloaded_ttft_p90_s"] > 3 * wide["unloaded_ttft_p50_s"]
    if fallback:
        assert wide["slo_rule"] == "3 x unloaded p90 request"
        assert wide["slo_s"] == pytest.approx(3 * wide["unloaded_ttft_p90_s"])
    else:
        assert wide["slo_rule"] == "3 x unloaded median request"
        assert wide["slo_s"] == wide["default_slo_s"]
    narrow = run_job(Job(foreign_trace(4), (2,), cfgs, {}, args, loader=load_foreign))  # within the median rule
    assert narrow["unloaded_ttft_p90_s"] <= narrow["slo_s"] == narrow["default_slo_s"]
    assert narrow["slo_rule"] == "3 x unloaded median request"


def test_miss_sources_sort_every_admitted_prompt_block_once_and_hits_match_the_replay():
    from bench.routing_report import capacity_blocks
    from bench.studies.miss_sources import CATEGORIES, MissSources
    from unicache.sim.replay import ReplayConfig

    trace = load_foreign(foreign_trace(1), {"duration": 60.0, "requests_per_s": 1.5})
    cap = capacity_blocks(trace, 0.02)  # at least twice the largest request: none rejected
    for router in ("cache_aware", "sglang"):
        rep = MissSources(trace, ReplayConfig("unicache", cap, replicas=3, router=router, lanes=4, rate_scale=1.0))
        rec = rep.run()
        assert rec["rejected"] == 0
        assert rep.blocks == sum(len(r.prompt_hashes) for r in trace.requests)
        assert sum(rep.counts[c] for c in CATEGORIES) == rep.blocks
        assert rep.counts["hit"] == rep.counters.hit_blocks
        assert min(rep.counts.values()) >= 0


def test_foreign_eviction_compares_unicache_with_the_best_classic_policy_per_capacity():
    from bench.studies.foreign_eviction import compare

    def rec(policy, frac, hit):
        return {"policy": policy, "capacity_frac": frac, "capacity_blocks": int(frac * 1000), "block_hit_ratio": hit}

    run = {"results": [rec("lru", 0.02, 0.10), rec("arc", 0.02, 0.15), rec("unicache", 0.02, 0.14), rec("opt", 0.02, 0.30),
                       rec("lru", 0.05, 0.20), rec("s3fifo", 0.05, 0.22), rec("unicache", 0.05, 0.22)]}
    small, large = compare(run, [0.02, 0.05])
    assert (small["best_classic"], small["best_classic_hit"], small["ok"], small["opt"]) == ("arc", 0.15, False, 0.30)
    assert (large["best_classic"], large["ok"], large["opt"]) == ("s3fifo", True, None)  # a tie meets it
    assert small["capacity_blocks"] == 20 and small["lru"] == 0.10


def test_foreign_host_tier_counts_each_target_and_the_ttft_rows_out_of_any_host_tiers_reach():
    from bench.studies.foreign_host_tier import markdown

    checks = [{"target": "unicache - lru block hit ratio, host 4x >= 0", "where": "w", "value": 0.001, "ok": True},
              {"target": "unicache - lru block hit ratio, host 10x >= 0", "where": "w", "value": -0.002, "ok": False},
              {"target": "lru: mean TTFT with host 4x / without <= 0.6", "where": "w", "value": 0.9, "ok": False,
               "bound": 0.1}]
    report = {"command": "c", "host": "h", "cpus": 2, "commit": "abc", "wall_s": 60.0, "duration": 1200.0,
              "traces": [{"name": "t", "checks": checks}]}
    md = markdown(report)
    assert "**1 of 2** rows" in md and "**0 of 1**" in md
    assert "In 0 of those rows" in md and "of the other 1, 0 meet it" in md
    assert "| t | w | unicache - lru block hit ratio, host 10x >= 0 | -0.20 points | - | NO |" in md
