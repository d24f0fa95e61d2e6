"""Per-trace preparation: hashes, chaining of decode blocks, counts, classes."""

from __future__ import annotations

import json

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import Task
from unicache.router.routing.registry import routing_policy_names
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig, _pump
from unicache.sim.trace import TraceRequest, parse_trace_line
from unicache.sim.workload import WorkloadConfig, generate


def tr(ts, ids, out_ids=(), input_length=None, output_length=0, **labels) -> TraceRequest:
    return TraceRequest(0, ts, input_length or 4 * len(ids), output_length, list(ids), list(out_ids), **labels)


def test_decode_hashes_continue_the_prompt_chain():
    p = prepare([tr(0, [1, 2], [3, 4], output_length=8, tenant="acme")], 4)
    r = p.requests[0]
    full = hash_id_blocks([1, 2, 3, 4], cache_salt=b"acme")
    assert r.prompt_hashes == full[:2] and r.output_hashes == full[2:]
    assert r.prompt_hashes != hash_id_blocks([1, 2])  # salted
    assert (r.prompt_tokens, r.num_tokens) == (8, 16)


def test_counts_and_reserved_tokens():
    p = prepare([tr(0, [1, 2], input_length=6, output_length=5), tr(1, [1, 9], [7])], 4)
    assert p.block_accesses == 4
    assert p.unique_blocks == 4  # h1, h1-h2, h1-h9, h1-h9-h7
    assert [r.num_tokens for r in p.requests] == [8 + 5, 12]
    assert [r.index for r in p.requests] == [0, 1] and [r.rid for r in p.requests] == ["0", "1"]
    assert not p.labelled and p.classifier_accuracy is None
    assert all(r.truth is None for r in p.requests)


def test_labels_give_the_class():
    p = prepare([
        tr(0, [1], session_id="s", turn=0, task=Task.AGENT, tenant="t"),
        tr(5000, [2], task=Task.CODE, template=True, turn=0),
    ], 4)
    a, b = (r.cls for r in p.requests)
    assert (a.session_id, a.turn, a.task, a.tenant, a.template) == ("s", 0, Task.AGENT, "t", False)
    assert (b.session_id, b.task, b.template) == (None, Task.CODE, True)
    assert [r.task_key for r in p.requests] == ["agent", "code"]
    assert p.labelled and p.requests[0].truth.session_id == "s"


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        prepare([tr(0, [1])], 0)


@pytest.mark.parametrize("router", routing_policy_names())
def test_every_router_keeps_the_index_equal_to_the_stores(router):
    recs = generate(WorkloadConfig(seed=11, duration=60.0, tenants=2))
    trace = [parse_trace_line(json.dumps(r), "mix", i + 1, i) for i, r in enumerate(recs)]
    prepared = prepare(trace, 16)
    sim = Replay(prepared, ReplayConfig("lru", 300, replicas=3, router=router))
    res = sim.run()
    assert res["rejected"] == 0
    # a replica looks up only the blocks a hit may cover (each prompt's last token is computed)
    assert sum(r.store.stats.query_blocks for r in sim.replicas) == sum(r.reusable_blocks for r in prepared.requests)
    assert sum(r.reusable_blocks for r in prepared.requests) < prepared.block_accesses
    assert sum(r.store.stats.hit_blocks for r in sim.replicas) == res["hit_blocks"]
    assert res["evictions"] > 0
    for rep in sim.replicas:
        assert (rep.running, rep.in_flight, len(rep.waiting), rep.busy_lanes) == (0, 0, 0, 0)
        _pump(sim.index, rep.replica_id, rep.store.take_events())
        assert set(sim.index.holdings(rep.replica_id).blocks) == set(rep.store.cached_hashes())
        rep.store.check_invariants()
