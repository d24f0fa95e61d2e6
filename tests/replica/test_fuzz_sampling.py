"""Property: sampling never fails, whatever temperature / top_p / logits a request brings.

Found by the HTTP fuzz (tests/router/test_fuzz_http.py): a temperature such as 1e-40 made
``logits / temperature`` overflow, softmax returned NaN, and ``torch.multinomial`` raised
inside the engine step, which failed every request in flight on that replica.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from unicache.replica.engines.api import SamplingParams
from unicache.replica.engines.builtin.sampling import make_generator, sample

logit_rows = st.lists(st.floats(-1e4, 1e4, width=32), min_size=2, max_size=64).map(lambda xs: torch.tensor(xs, dtype=torch.float32))
temperatures = st.one_of(
    st.floats(min_value=0.0, exclude_min=True, width=32),  # denormals up to float32 max
    st.sampled_from([1e-45, 1e-40, 1e-30, 1e-8, float("inf")]),
)
top_ps = st.one_of(st.just(1.0), st.floats(min_value=0.0, max_value=1.0, exclude_min=True, width=32))


@given(logits=logit_rows, temperature=temperatures, top_p=top_ps, seed=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None)
def test_sample_returns_a_valid_token_for_any_accepted_parameters(logits, temperature, top_p, seed):
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    token = sample(logits, params, make_generator(params, 0, 0))
    assert 0 <= token < logits.numel()


int_logit_rows = st.lists(st.integers(-1000, 1000), min_size=2, max_size=64).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


@given(logits=int_logit_rows, seed=st.integers(0, 2**32))
@settings(max_examples=100, deadline=None)
def test_a_vanishing_temperature_is_greedy(logits, seed):
    """Logits at least 1 apart (integers) and T = 1e-40: only the top logits can be drawn."""
    params = SamplingParams(temperature=1e-40, seed=seed)
    token = sample(logits, params, make_generator(params, 0, 0))
    assert logits[token] == logits.max()
