"""Every vLLM event schema in use decodes (unicache/contract/vllm_event_schema.py): batches
recorded with each release's own structs (tests/support/vllm_events/, made by
tools/record_vllm_events.py) decode to exact events and translate to exact hashes, and a
hybrid model's groups bound prefix hits in the index."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from unicache.contract.block_hash import ROOT_HASH, block_extra_keys, hash_block, hash_token_blocks
from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.kv_tier import Tier
from unicache.contract.vllm_event_schema import (
    SCHEMAS,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    decode_batch,
    schema_of,
)
from unicache.contract.vllm_events import EventTranslator, group_role
from unicache.router.cluster.index import LocalityIndex

RECORDINGS = Path(__file__).parents[1] / "support" / "vllm_events"
SALT = "cd" * 8
TOKENS = list(range(1, 13))

# release -> (form, the BlockStored fields it publishes beyond the first six, STORAGE medium)
RELEASES = {
    "0.11.0": ("array", set(), False),
    "0.15.0": ("array", {"lora_name"}, False),
    "0.20.0": ("array", {"lora_name", "extra_keys", "group_idx"}, False),
    "0.23.0": ("array", {"lora_name", "extra_keys", "group_idx", "kinds"}, False),
    "0.24.0": ("map", {"lora_name", "extra_keys", "group_idx", "kinds"}, False),
    "0.26.0": ("map", {"lora_name", "extra_keys", "group_idx", "kinds"}, False),
    "0.32.0": ("map", {"lora_name", "extra_keys", "group_idx", "kinds", "session_id"}, True),
}


def H(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payloads(release: str) -> list[bytes]:
    return msgspec.msgpack.decode((RECORDINGS / f"{release}.msgpack").read_bytes())


def expected_batches(release: str) -> list[list]:
    """What tools/record_vllm_events.py's scenario is, as this release publishes it."""
    _form, has, storage = RELEASES[release]

    def stored(hashes, parent, tokens, medium="GPU", lora_id=None, lora_name=None, extra=None, group=None, kind=None,
               window=None, session=None):
        return VllmBlockStored(
            hashes, parent, tokens, 4, lora_id=lora_id, medium=medium,
            lora_name=lora_name if "lora_name" in has else None,
            extra_keys=extra if "extra_keys" in has else None,
            group_idx=group if "group_idx" in has else None,
            kv_cache_spec_kind=kind if "kinds" in has else None,
            kv_cache_spec_sliding_window=window if "kinds" in has else None,
            session_id=session if "session_id" in has else None,
        )

    def removed(hashes, group=None):
        return VllmBlockRemoved(hashes, "GPU", group if "group_idx" in has else None)

    batches = [
        [stored([H(0), H(1)], None, TOKENS[:8], extra=[[SALT], None], group=0, kind="full_attention", session="sess-1")],
        [stored([H(2)], H(1), TOKENS[8:12], extra=[None], group=0, kind="full_attention"),
         stored([H(0)], None, TOKENS[:4], medium="CPU", extra=[[SALT]]),
         *([stored([H(0)], None, TOKENS[:4], medium="STORAGE", extra=[[SALT]])] if storage else []),
         removed([H(2)], group=0)],
        [stored([H(3)], None, TOKENS[:4], lora_id=7, lora_name="sql", extra=[["sql"]], group=0, kind="full_attention")],
        [VllmAllBlocksCleared()],
    ]
    if "group_idx" in has:
        batches.append([
            stored([H(0), H(1), H(2)], None, TOKENS, extra=[None, None, None], group=0, kind="full_attention"),
            stored([H(1), H(2)], None, TOKENS, extra=[None, None], group=1, kind="sliding_window", window=4),
            removed([H(1)], group=1),
        ])
    return batches


def as_plain(ev) -> tuple:
    return (ev.__struct_config__.tag, msgspec.structs.asdict(ev))


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_release_recording_decodes_to_its_exact_events(release):
    form = RELEASES[release][0]
    got = [decode_batch(p) for p in payloads(release)]
    assert [b.ts for b in got] == [1000.0 + i for i in range(len(got))]
    assert {b.data_parallel_rank for b in got} == {0}
    assert [[as_plain(e) for e in b.events] for b in got] == [[as_plain(e) for e in b] for b in expected_batches(release)]
    assert {schema_of(b) for b in got} == {form}
    # the form tried first does not matter
    assert [[as_plain(e) for e in decode_batch(p, form="array").events] for p in payloads(release)] == \
        [[as_plain(e) for e in b.events] for b in got]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_release_recording_translates_to_our_exact_hashes(release):
    _form, has, _storage = RELEASES[release]
    t = EventTranslator(clock=lambda: 5.0)
    out = [t.translate(decode_batch(p)) for p in payloads(release)]
    assert t.schema == RELEASES[release][0]
    salt = bytes.fromhex(SALT) if "extra_keys" in has else None  # before extra_keys the salt is not on the wire
    s0, s1, s2 = hash_token_blocks(TOKENS, 4, cache_salt=salt)
    assert out[0] == [BlockStored(s0, None, 5.0, Tier.GPU), BlockStored(s1, s0, 5.0, Tier.GPU)]
    assert out[1] == [BlockStored(s2, s1, 5.0, Tier.GPU), BlockStored(s0, None, 5.0, Tier.HOST), BlockRemoved(s2, 5.0, Tier.GPU)]
    # 0.11 names only the adapter's lora_id: its blocks are kept apart from the base model's
    lora = "sql" if "lora_name" in has else "lora-id:7"
    assert out[2] == [BlockStored(hash_block(ROOT_HASH, TOKENS[:4], block_extra_keys(0, None, lora)), None, 5.0, Tier.GPU)]
    assert out[3] == [AllBlocksCleared(5.0)]
    if "group_idx" not in has:
        assert len(out) == 4
        return
    u0, u1, u2 = hash_token_blocks(TOKENS, 4)
    if "kinds" in has:
        # group 1 is a 4-token sliding window: 1 block; it held u1, u2 and dropped u1
        assert out[4] == [BlockStored(u0, None, 5.0, Tier.GPU), BlockStored(u1, u0, 5.0, Tier.GPU), BlockStored(u2, u1, 5.0, Tier.GPU)]
        assert t.window_constraints() == [(1, {u2})]
        assert sorted(t.cached_hashes()) == sorted([u0, u1, u2])
    else:
        # 0.20 names groups but not their kinds: group 1 counts as full attention, so only
        # what both groups hold is indexed (group 1 never held u0 and dropped u1)
        assert out[4] == [
            BlockStored(u0, None, 5.0, Tier.GPU), BlockStored(u1, u0, 5.0, Tier.GPU), BlockStored(u2, u1, 5.0, Tier.GPU),
            BlockRemoved(u0, 5.0, Tier.GPU), BlockRemoved(u1, 5.0, Tier.GPU), BlockRemoved(u2, 5.0, Tier.GPU),
            BlockStored(u1, u0, 5.0, Tier.GPU), BlockStored(u2, u1, 5.0, Tier.GPU), BlockRemoved(u1, 5.0, Tier.GPU),
        ]
        assert t.window_constraints() == [] and t.cached_hashes() == [u2]


def test_garbage_is_refused_by_both_forms():
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [["NotAnEvent", 1]], 0]))
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1")
    assert schema_of(decode_batch(msgspec.msgpack.encode(VllmEventBatch(1.0, [])))) is None


@pytest.mark.parametrize(("kind", "window", "role"), [
    (None, None, ("full", 0)), ("full_attention", None, ("full", 0)), ("mla_attention", None, ("full", 0)),
    ("sliding_window", 4, ("window", 1)), ("sliding_window", 5, ("window", 1)), ("sliding_window", 6, ("window", 2)),
    ("sliding_window", 1024, ("window", 256)), ("sliding_window_mla", 9, ("window", 2)), ("sliding_window", None, ("full", 0)),
    ("mamba", None, ("window", 1)), ("cross_attention", None, ("ignored", 0)), ("unknown", None, ("ignored", 0)),
])
def test_group_roles_follow_vllms_hit_rule(kind, window, role):
    assert group_role(kind, window, 4) == role


def hybrid_batch(*events) -> VllmEventBatch:
    return decode_batch(msgspec.msgpack.encode(VllmEventBatch(1.0, list(events))))


def full(hashes, parent, tokens):
    return VllmBlockStored(hashes, parent, tokens, 4, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")


def window(hashes, parent, tokens, size=8):
    return VllmBlockStored(hashes, parent, tokens, 4, medium="GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                           kv_cache_spec_sliding_window=size)


def test_a_hybrid_backend_hits_only_as_far_as_its_window_holds_the_blocks_it_needs():
    """An 8-token window needs 2 blocks (cdiv(8 - 1, 4)): a prefix of n blocks is a hit when
    the window group holds blocks n-2 and n-1, the full-attention group all n."""
    toks = list(range(100, 124))  # six blocks
    ours = hash_token_blocks(toks, 4)
    t = EventTranslator()
    index = LocalityIndex()
    vh = [H(100 + i) for i in range(6)]
    events = t.translate(hybrid_batch(
        window(vh[2:4], None, toks[:16]),  # window events first on the wire: translated after the full group's
        full(vh, None, toks),
        VllmBlockRemoved([vh[2]], "GPU", 1),
    ))
    assert [e.block_hash for e in events] == ours
    from unicache.router.upstream.vllm_fleet.follower import apply_events

    apply_events(index, "hybrid", events)
    index.set_windows("hybrid", t.window_constraints())
    assert t.window_constraints() == [(2, {ours[3]})]
    # the window holds only block 3: n=6..5 need blocks 4,5 / 3,4; n=4 needs 2,3; n=1 needs 0
    assert index.prefix_matches(ours) == {"hybrid": 0}
    t.translate(hybrid_batch(window([vh[2]], vh[1], toks[8:12])))
    assert index.prefix_matches(ours) == {"hybrid": 4}
    assert index.prefix_matches(ours[:3]) == {"hybrid": 0}  # needs blocks 1, 2
    t.translate(hybrid_batch(window([vh[4], vh[5]], vh[3], toks[16:24])))
    assert index.prefix_matches(ours) == {"hybrid": 6}
    assert index.match("hybrid", ours[:5]) == 5
    # a plain backend beside it is not cut, also when many replicas share the prefix
    index.apply_events_unchecked("plain", ours, [], [None, *ours[:-1]])
    t.translate(hybrid_batch(VllmBlockRemoved([vh[5]], "GPU", 1)))
    assert index.prefix_matches(ours) == {"hybrid": 5, "plain": 6}
    deep, groups = index.prefix_match_groups(ours, wide=1)
    assert (deep, groups) == ({"hybrid": 5, "plain": 6}, [])
    index.set_windows("hybrid", [])
    assert index.prefix_matches(ours) == {"hybrid": 6, "plain": 6}


def test_a_window_shorter_than_the_prefix_start_needs_every_block():
    toks = list(range(8))
    ours = hash_token_blocks(toks, 4)
    index = LocalityIndex()
    index.apply_events_unchecked("r", ours, [], [None, ours[0]])
    index.set_windows("r", [(3, {ours[1]})])  # n < 3: blocks 0..n-1 all needed
    assert index.prefix_matches(ours) == {"r": 0}
    index.set_windows("r", [(3, {ours[0], ours[1]})])
    assert index.prefix_matches(ours) == {"r": 2}
    index.drop_replica("r")
    assert index.prefix_matches(ours) == {}


@pytest.mark.parametrize(("release", "schema"), [("0.32.0", "map"), ("0.23.0", "array")])
def test_the_follower_records_the_schema_and_hands_a_hybrid_backends_windows_to_the_index(release, schema, caplog):
    from unicache.router.cluster.view import ClusterView
    from unicache.router.routing.registry import make_routing_policy
    from unicache.router.upstream.vllm_fleet.follower import BackendFollower
    from unicache.router.upstream.vllm_fleet.spec import BackendSpec

    caplog.set_level("INFO", logger="unicache.router.upstream.vllm_fleet.follower")
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    f = BackendFollower(BackendSpec("h", "http://h:1"), cluster, None, 4)
    f.apply([decode_batch(p) for p in payloads(release)])
    u = hash_token_blocks(TOKENS, 4)
    # the full-attention group holds u0..u2, the 1-block window only u2
    assert cluster.index.prefix_matches(u) == {"h": 3}
    assert cluster.index.prefix_matches(u[:2]) == {"h": 0}  # n=2 needs block 1, n=1 block 0: the window dropped both
    assert cluster.backend_schema == {"h": schema}
    f.apply([decode_batch(p) for p in payloads(release)])  # the same form again: not logged again
    lines = [r.getMessage() for r in caplog.records if "publishes KV events" in r.getMessage()]
    assert lines == [f"backend h publishes KV events in the {schema} form: {SCHEMAS[schema]}"]


def test_a_dispatch_of_an_indexed_prefix_leaves_the_window_cut_alone():
    """Routing a prompt whose blocks the index holds marks nothing pending: no event will
    confirm them, and counting them past a hybrid backend's cut match would undo the cut
    (vLLM would hit nothing where the router predicted the whole prefix)."""
    from unicache.router.cluster.view import ClusterView
    from unicache.router.routing.registry import make_routing_policy

    index = LocalityIndex()
    cluster = ClusterView(make_routing_policy("round_robin"), index)
    cluster.backend_events = 1
    u = hash_token_blocks(list(range(24)), 4)  # six blocks
    index.apply_events_unchecked("h", u, [], [None, *u[:-1]])
    index.set_windows("h", [(2, {u[4], u[5]})])
    assert index.held_prefix("h", u) == 6 and index.held_prefix("h", u[:3] + [b"x" * 16]) == 3
    cluster.pending.add("h", u)  # the whole prompt again: all held
    cluster.pending.add("h", u[:5] + hash_token_blocks(list(range(20)) + [99] * 4, 4)[5:])  # 5 held, 1 new
    assert len(cluster.pending) == 1
    assert cluster.locality().prefix_matches(u[:5]) == {"h": 0}  # n=5 needs blocks 3, 4: block 3 is not in the window
    assert cluster.locality().prefix_matches(u) == {"h": 6}
