"""Random interleavings of requests, aborts and steps on a small cache (hypothesis).

Whatever the interleaving (shared prefixes, forks, evictions, preemptions, aborts), the
store's invariants hold after every step, greedy outputs equal the cold-cache outputs,
and no block stays referenced at the end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.engine.engine import LLMEngine
from tests.support.engine_factory import make_request, run_one, tiny_config

TEMPLATES = [[(t * 41 + i * 7) % 256 for i in range(13)] for t in range(3)]

request_st = st.tuples(
    st.sampled_from(range(3)),  # template
    st.lists(st.integers(0, 255), min_size=1, max_size=9),  # suffix
    st.integers(1, 10),  # max_tokens
    st.integers(1, 3),  # n
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


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=25))
def test_random_interleavings_keep_invariants_and_cold_outputs(ops):
    eng = LLMEngine(tiny_config(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24))
    requests = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    aborted = set()

    def step():
        for out in eng.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        eng.check_invariants()

    for kind, arg in ops:
        if kind == "add":
            tmpl, suffix, max_tokens, n = arg
            rid = f"r{len(requests)}"
            req = make_request(rid, TEMPLATES[tmpl] + suffix, max_tokens=max_tokens, n=n)
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
