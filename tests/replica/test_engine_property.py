"""Random interleavings of requests, aborts and steps on a small cache (hypothesis).

Whatever the interleaving (shared prefixes, forks, evictions, preemptions, aborts), the
store's invariants hold after every step, greedy outputs equal the cold-cache outputs,
and no block stays referenced at the end.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.contract.request_class import SINGLE_TURN, RequestClass, Task
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.eviction.registry import policy_names
from tests.support.engine_factory import make_request, run_one, tiny_config

CLASSES = [
    SINGLE_TURN,
    RequestClass(session_id="s1", turn=1, task=Task.CHAT),
    RequestClass(session_id="s2", turn=2, task=Task.AGENT),
    RequestClass(task=Task.QA, template=True, template_blocks=3),
]
TEMPLATES = [[(t * 41 + i * 7) % 256 for i in range(13)] for t in range(3)]

request_st = st.tuples(
    st.sampled_from(range(3)),  # template
    st.lists(st.integers(0, 255), min_size=1, max_size=9),  # suffix
    st.integers(1, 10),  # max_tokens
    st.integers(1, 3),  # n
    st.sampled_from(range(len(CLASSES))),  # request class (drives the eviction queues)
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)

_COLD: dict[tuple, list[int]] = {}


def cold_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _COLD:
        eng = LLMEngine(tiny_config(enable_prefix_caching=False))
        _COLD[key] = run_one(eng, make_request("cold", prompt, max_tokens=max_tokens)).tokens[0]
    return _COLD[key]


# Every online policy the engine can run ("opt" needs the future: simulator only).
ONLINE_POLICIES = [p for p in policy_names() if p != "opt"]


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=25))
def test_random_interleavings_keep_invariants_and_cold_outputs(policy, ops):
    eng = LLMEngine(
        tiny_config(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24, eviction_policy=policy)
    )
    requests = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    aborted = set()

    def step():
        for out in eng.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        eng.check_invariants()

    for kind, arg in ops:
        if kind == "add":
            tmpl, suffix, max_tokens, n, cls = arg
            rid = f"r{len(requests)}"
            req = make_request(rid, TEMPLATES[tmpl] + suffix, max_tokens=max_tokens, n=n)
            req.cls = CLASSES[cls]
            requests[rid] = req
            eng.add_request(req)
        elif kind == "step":
            for _ in range(arg):
                step()
        elif requests:
            rid = f"r{arg % len(requests)}"
            if eng.abort(rid):
                aborted.add(rid)
            eng.check_invariants()
    while eng.has_unfinished():
        step()
    assert eng.num_referenced_blocks() == 0
    for rid, req in requests.items():
        if rid in aborted:
            continue
        want = cold_tokens(req.prompt_token_ids, req.sampling.max_tokens)
        for i in range(req.sampling.n):
            assert tokens[(rid, i)] == want, (rid, i)
