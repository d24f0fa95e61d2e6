"""Exact RequestClass outcomes of the request classifier."""

from __future__ import annotations

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass, Task
from unicache.router.request_path.classifier import Labels, RequestClassifier


def H(*ids: int, salt: bytes | None = None):
    return hash_id_blocks(list(ids), cache_salt=salt)


def test_first_request_is_single_turn_without_template():
    c = RequestClassifier()
    assert c.classify(H(1, 2, 3), None, 0.0) == RequestClass(inferred=True)


def test_prompt_containing_earlier_whole_prompt_is_next_turn():
    c = RequestClassifier()
    c.classify(H(1, 2, 3), None, 0.0)
    second = c.classify(H(1, 2, 3, 4, 5), None, 100.0)
    assert second == RequestClass(session_id="auto-1", turn=1, task=Task.CHAT, inferred=True)
    third = c.classify(H(1, 2, 3, 4, 5, 6, 7), None, 250.0)
    assert third == RequestClass(session_id="auto-1", turn=2, task=Task.CHAT, inferred=True)


def test_partial_last_block_recompleted_by_next_turn_still_matches():
    # The trace's last id is a partial block; the next turn completes it with new content.
    c = RequestClassifier()
    c.classify(H(1, 2, 3, 9), None, 0.0)
    nxt = c.classify(H(1, 2, 3, 4, 5), None, 60.0)
    assert (nxt.session_id, nxt.turn) == ("auto-1", 1)


def test_short_gaps_make_an_agent_session():
    c = RequestClassifier(agent_gap_s=25.0)
    c.classify(H(1, 2), None, 0.0)
    a = c.classify(H(1, 2, 3), None, 3.0)
    b = c.classify(H(1, 2, 3, 4), None, 8.0)
    assert (a.task, b.task) == (Task.AGENT, Task.AGENT)
    assert (a.turn, b.turn) == (1, 2)


def test_prefix_shared_across_sessions_is_template_with_its_length():
    c = RequestClassifier()
    c.classify(H(7, 8, 10, 11), None, 0.0)
    second = c.classify(H(7, 8, 20, 21), None, 1.0)
    assert second == RequestClass(template=True, template_blocks=2, inferred=True)
    third = c.classify(H(7, 8, 30, 31, 32), None, 2.0)
    assert (third.template, third.template_blocks, third.session_id) == (True, 2, None)


def test_shared_prefix_is_not_a_session_even_if_it_equals_an_earlier_prompt_end():
    # Request 1's second-to-last block ends the template; request 2 looks like its next
    # turn, but request 3 branches from the same turn, so it is a template (not turn 2).
    c = RequestClassifier()
    c.classify(H(7, 8, 9), None, 0.0)
    c.classify(H(7, 8, 20, 21), None, 1.0)
    third = c.classify(H(7, 8, 30, 31), None, 2.0)
    assert third == RequestClass(template=True, template_blocks=2, inferred=True)


def test_template_blocks_do_not_start_a_session_for_everyone():
    c = RequestClassifier()
    c.classify(H(0, 1, 2), None, 0.0)
    c.classify(H(0, 3, 4), None, 1.0)
    # Block 0 alone ends no prompt privately: it is shared, so no turn is inferred.
    k = c.classify(H(0, 5, 6), None, 2.0)
    assert (k.session_id, k.template_blocks) == (None, 1)


def test_tenants_are_kept_apart_by_the_salt():
    c = RequestClassifier()
    c.classify(H(1, 2, 3, salt=b"a"), Labels(tenant="a"), 0.0)
    other = c.classify(H(1, 2, 3, 4, salt=b"b"), Labels(tenant="b"), 10.0)
    assert other == RequestClass(tenant="b", inferred=True)


def test_explicit_labels_win_field_by_field():
    c = RequestClassifier()
    full = Labels(tenant="t", session_id="s1", turn=4, task=Task.CODE, template=False)
    assert c.classify(H(1, 2), full, 0.0) == RequestClass(
        tenant="t", session_id="s1", turn=4, task=Task.CODE, template=False, inferred=False
    )
    # Session given, turn and task inferred from that session's history.
    nxt = c.classify(H(5, 6), Labels(tenant="t", session_id="s1"), 2.0)
    assert nxt == RequestClass(tenant="t", session_id="s1", turn=1, task=Task.CODE, inferred=True)


def test_labelled_template_on_first_sighting_covers_the_whole_prompt():
    c = RequestClassifier()
    k = c.classify(H(1, 2, 3), Labels(session_id=None, task=Task.TOOL, template=True), 0.0)
    assert (k.template, k.template_blocks, k.task) == (True, 3, Task.TOOL)
    k2 = c.classify(H(1, 2, 4, 5), Labels(task=Task.TOOL, template=True), 1.0)
    assert (k2.template, k2.template_blocks) == (True, 2)


def test_memory_stays_bounded():
    c = RequestClassifier(max_prompts=10, max_blocks=50)
    for i in range(100):
        c.classify(H(1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i), None, float(i))
    assert len(c) == 10
    assert len(c._blocks) == 50


@pytest.mark.parametrize("kwargs", [{"agent_gap_s": 0}, {"gap_ema": 0}, {"template_min_sessions": 1}])
def test_bad_tunables_raise(kwargs):
    with pytest.raises(ValueError):
        RequestClassifier(**kwargs)


def test_a_sessions_shared_system_prompt_is_not_reported_as_template():
    c = RequestClassifier()
    c.classify(H(50, 51, 1, 2), None, 0.0)
    c.classify(H(50, 51, 3, 4), None, 1.0)  # another conversation, same system prompt
    nxt = c.classify(H(50, 51, 3, 4, 5, 6), None, 90.0)
    assert nxt == RequestClass(session_id="auto-2", turn=1, task=Task.CHAT, inferred=True)
