"""Reusing the token ids of chat prefixes (router/request_path/prefix_tokens.py): every encode
equals the tokenizer's own on tokenizers shaped as real chat models' (unicache/testing/
chat_tokenizers.py) and the project's word-level one; a chat's later turns reuse what the
earlier ones kept; a tokenizer where a cut changes the ids is tokenized whole."""

from __future__ import annotations

import random

import pytest

from unicache.contract.chat_template import render_chat
from unicache.contract.tokenizer import ByteTokenizer, HFTokenizer
from unicache.router.request_path.prefix_tokens import PrefixReusingTokenizer
from unicache.testing.chat_tokenizers import chat_turns, chat_words, write_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, HFTokenizer]:
    return {kind: HFTokenizer(write_chat_tokenizer(str(tmp_path_factory.mktemp(kind)), kind))
            for kind in ("chatml", "llama3", "metaspace", "words")}


@pytest.mark.parametrize("kind, cuts", [
    ("chatml", ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]),
    ("llama3", ["<|begin_of_text|>", "<|end_header_id|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]),
    ("metaspace", []),  # SentencePiece's "prepend to the first piece only": no cut is safe
    ("words", ["</s>", "<s>", "<unk>"]),
])
def test_chats_reuse_their_history_and_every_encode_is_the_tokenizers_own(tokenizers, kind, cuts):
    tok = tokenizers[kind]
    assert tok.split_tokens() == cuts
    reusing = PrefixReusingTokenizer(tok, verify_every=1)  # every reuse checked against a whole encode too
    as_completion = PrefixReusingTokenizer(tok, verify_every=1)
    assert reusing.enabled == bool(cuts)
    rng = random.Random(7)
    chats = [chat_turns(rng, 6, 40, kind) for _ in range(3)]
    for turn in range(6):  # the chats interleave, as a router sees them
        for chat in chats:
            prompt = render_chat(chat[turn], tok.chat_template)
            assert reusing.encode(prompt) == tok.encode(prompt)
            # with special tokens added (as a completion prompt: its word cuts), in another instance
            assert as_completion.encode(prompt, add_special_tokens=True) == tok.encode(prompt, add_special_tokens=True)
    assert as_completion.mismatches == 0
    if cuts:  # each chat's first turn misses, every later one reuses
        assert (reusing.misses, reusing.hits, reusing.mismatches) == (3, 15, 0)
        assert reusing.reused_tokens > 0
    else:
        assert (reusing.misses, reusing.hits) == (0, 0)


@pytest.mark.parametrize("kind", ["chatml", "llama3", "words", "metaspace"])
def test_completion_prompts_sharing_a_head_reuse_it_and_every_encode_is_the_tokenizers_own(tokenizers, kind):
    tok = tokenizers[kind]
    reusing = PrefixReusingTokenizer(tok, verify_every=1)  # every reuse checked against a whole encode too
    rng = random.Random(5)
    heads = [chat_words(rng, 900) for _ in range(2)]  # ~5,000 characters: cuts at 1,024, 2,048, ...
    for i in range(6):
        prompt = heads[i % 2] + " " + chat_words(rng, 200)
        assert reusing.encode(prompt, add_special_tokens=True) == tok.encode(prompt, add_special_tokens=True)
        assert reusing.encode(prompt) == tok.encode(prompt)
    if kind == "metaspace":  # no safe cut (SentencePiece's first piece): whole, nothing kept
        assert (reusing.enabled, reusing.hits, reusing.misses, reusing.kept_tokens) == (False, 0, 0, 0)
        return
    # each head's first prompt misses, every later one reuses it (a plain encode, as a
    # rendered chat's, has no delimiter here: it is tokenized whole, and not counted)
    assert (reusing.misses, reusing.hits, reusing.mismatches) == (2, 4, 0)
    assert reusing.reused_tokens >= 4 * len(tok.encode(heads[0])) * 3 // 4  # most of each head


def test_word_cuts_fall_on_the_first_boundary_after_each_stride():
    from unicache.router.request_path.prefix_tokens import STRIDE, PrefixReusingTokenizer as P

    text = "a" * (STRIDE - 2) + " bb" + " c" * STRIDE  # spaces at 1,022, then 1,025, 1,027, ... 3,071
    assert P._word_cut_points(None, text) == [STRIDE + 1, 2 * STRIDE + 1]  # before a space that starts a word
    assert P._word_cut_points(None, "x" * 5000) == []  # no boundary: one piece
    assert P._word_cut_points(None, "a " * 100) == []  # shorter than a stride


def test_a_cut_the_self_test_sees_change_the_ids_turns_reuse_off(tokenizers):
    tok = tokenizers["metaspace"]

    class Claims(HFTokenizer):  # claims its [/INST] is a safe cut: it is not
        def split_tokens(self) -> list[str]:
            return ["[/INST]"]

    claims = object.__new__(Claims)
    claims.__dict__.update(tok.__dict__)
    text = "[INST] hello world [/INST]answer"
    assert tok.encode(text) != tok.encode("[INST] hello world [/INST]") + tok.encode("answer")
    reusing = PrefixReusingTokenizer(claims)
    assert not reusing.enabled and reusing.encode(text) == tok.encode(text)


def test_a_difference_found_at_run_time_turns_reuse_off_for_good(tokenizers):
    tok = tokenizers["chatml"]
    reusing = PrefixReusingTokenizer(tok, verify_every=1)
    chat = chat_turns(random.Random(1), 3, 20)
    first, second = (render_chat(m, tok.chat_template) for m in chat[:2])
    reusing.encode(first)
    key = next(reversed(reusing._kept))
    reusing._kept[key].ids[0] += 1  # a kept prefix gone wrong: the check must catch it
    assert reusing.encode(second) == tok.encode(second)
    assert (reusing.enabled, reusing.mismatches, reusing.kept_tokens) == (False, 1, 0)
    assert reusing.encode(second) == tok.encode(second) and reusing.hits == 1


def test_the_kept_ids_stay_within_their_bound(tokenizers):
    tok = tokenizers["llama3"]
    reusing = PrefixReusingTokenizer(tok, max_tokens=400)
    rng = random.Random(3)
    for _ in range(10):
        prompt = render_chat(chat_turns(rng, 2, 30, "llama3")[1], tok.chat_template)
        assert reusing.encode(prompt) == tok.encode(prompt)
        assert 0 < reusing.kept_tokens <= 400
        assert reusing.kept_tokens == sum(len(p.ids) for p in reusing._kept.values())


def test_a_tokenizer_without_special_tokens_is_used_as_it_is():
    reusing = PrefixReusingTokenizer(ByteTokenizer())
    assert not reusing.enabled and reusing.encode("héllo") == list("héllo".encode()) and reusing.eos_token_id == 257
    with pytest.raises(ValueError, match="must be positive"):
        PrefixReusingTokenizer(ByteTokenizer(), max_tokens=0)


async def test_the_router_reuses_prefixes_by_default_and_exports_its_counts(tmp_path):
    from prometheus_client import generate_latest

    from unicache.router.app import RouterApp
    from tests.support.router_stack import config

    path = write_chat_tokenizer(str(tmp_path / "chatml"), "chatml") + "/tokenizer.json"
    app = RouterApp(config([], tokenizer=path))
    assert isinstance(app.core.tokenizer, PrefixReusingTokenizer) and app.core.tokenizer.max_tokens == 1_000_000
    tok = app.core.tokenizer.tokenizer
    for messages in chat_turns(random.Random(5), 3, 20):
        prompt = render_chat(messages, tok.chat_template)
        assert app.core.encode(prompt) == tok.encode(prompt)
    page = generate_latest(app.metrics.registry).decode()
    assert 'unicache_router_prefix_reuse{kind="hits"} 2.0' in page and 'unicache_router_prefix_reuse{kind="misses"} 1.0' in page
    assert not isinstance(RouterApp(config([], tokenizer=path, prefix_tokens_kept=0)).core.tokenizer, PrefixReusingTokenizer)
