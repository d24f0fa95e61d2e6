"""The router's memory budget: table caps derived from it, enforced, and honest about bytes."""

from __future__ import annotations

import random

import pytest

from unicache.contract.block_hash import hash_id_blocks
from unicache.contract.request_class import RequestClass
from unicache.plumbing.errors import UsageError
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.memory import BYTES_PER_ENTRY, MIB, SHARES, TableCaps, measure_bytes_per_entry, table_entries
from unicache.router.request_path.core import Labelled
from unicache.router.routing.base import RouteDecision, RoutingRequest
from unicache.router.routing.cache_aware.policy import CacheAwareConfig, CacheAwarePolicy


def test_caps_follow_the_budget():
    caps = TableCaps.for_budget(256)
    assert caps == TableCaps(
        classifier_blocks=int(256 * MIB * SHARES["classifier.blocks"] / BYTES_PER_ENTRY["classifier.blocks"]),
        classifier_prompts=int(256 * MIB * SHARES["classifier.prompts"] / BYTES_PER_ENTRY["classifier.prompts"]),
        classifier_sessions=int(256 * MIB * SHARES["classifier.sessions"] / BYTES_PER_ENTRY["classifier.sessions"]),
        policy_session_blocks=int(256 * MIB * SHARES["policy.session_blocks"] / BYTES_PER_ENTRY["policy.session_blocks"]),
    )
    assert TableCaps.for_budget(512).classifier_blocks == 2 * caps.classifier_blocks
    assert sum(SHARES.values()) == pytest.approx(0.3)  # the process itself and the index need the rest
    with pytest.raises(ValueError, match=">= 64 MiB"):
        TableCaps.for_budget(32)


def make_app(budget_mib: int = 256) -> RouterApp:
    cfg = build_config(env={}, overrides={"use_redis": False, "auth_enabled": False, "replicas": "r0=127.0.0.1:1,r1=127.0.0.1:2",
                                          "memory_budget_mib": budget_mib})
    return RouterApp(cfg)


def test_the_router_caps_its_tables_from_its_budget():
    app = make_app(128)
    caps = TableCaps.for_budget(128)
    c = app.core.classifier
    assert (c.max_blocks, c.max_prompts, c.max_sessions) == (caps.classifier_blocks, caps.classifier_prompts, caps.classifier_sessions)
    assert (app.policy.config.max_session_blocks, app.policy.config.max_sessions) == (caps.policy_session_blocks, caps.classifier_sessions)
    with pytest.raises(UsageError, match="memory_budget_mib must be >= 64"):
        build_config(env={}, overrides={"memory_budget_mib": 16})


def test_policy_sessions_are_bounded_in_hashes_oldest_first():
    p = CacheAwarePolicy(CacheAwareConfig(max_session_blocks=10))
    for i in range(5):  # sessions s0..s4 of 4 blocks each, on r0 then r1 alternately
        h = hash_id_blocks([100 * i + k for k in range(4)], 16)
        p.on_request_routed(RoutingRequest(f"q{i}", RequestClass(tenant="t", session_id=f"s{i}"), h, 64, 16),
                            RouteDecision(f"r{i % 2}", "load"))
    assert [k.split("\x1f")[1] for k in p._sessions] == ["s3", "s4"]  # 8 of 10; adding s4 dropped s0..s2
    assert p.session_blocks == 8
    d = 1 - 1 / 96
    assert p._footprint.as_dict() == pytest.approx({"r0": 4.0, "r1": 4 * d})  # s4 (just routed), s3 (one request ago)
    p.on_replica_died("r1")
    assert p.session_blocks == 4 and list(p._sessions) == ["t\x1fs4"]


def test_measured_entry_sizes_stay_under_the_constants_the_caps_use():
    app = make_app()
    rng = random.Random(0)
    core = app.core
    for i in range(3000):  # sessions, repeated templates and unique prompts
        kind = i % 3
        if kind == 0:
            ids = list(range(16 * 40)) + [rng.randrange(1 << 30) for _ in range(16 * rng.randint(1, 4))]
            sid = None
        elif kind == 1:
            ids = [i * 7919 + k for k in range(16 * rng.randint(4, 40))]
            sid = f"session-{i}"
        else:
            ids = [rng.randrange(1 << 30) for _ in range(16 * rng.randint(4, 40))]
            sid = None
        prep = core.prepare("default", ids, Labelled(session_id=sid))
        d = core.choose(prep.routing, set())
        app.policy.on_request_routed(prep.routing, d)
    entries = table_entries(app)
    assert entries["classifier.sessions"] == 1000 and entries["policy.sessions"] == 1000
    measured = measure_bytes_per_entry(app)
    assert set(measured) == set(BYTES_PER_ENTRY)
    for name, size in measured.items():
        assert 0 < size <= BYTES_PER_ENTRY[name], (name, size, BYTES_PER_ENTRY[name])
