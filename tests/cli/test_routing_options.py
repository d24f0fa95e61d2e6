"""cache_aware's settings (``CacheAwareConfig``) are settings: a flag, ``UNICACHE_ROUTING_OPTIONS``,
a config file's mapping, validated before anything starts, and the policy built with them."""

from __future__ import annotations

import json

import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.app import build_policy
from unicache.router.config import build_config
from tests.router.test_router_units import parse


def test_every_source_sets_the_policys_fields_with_the_usual_precedence(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("routing_options:\n  prefill_lanes: 2\n  load_weight: 0.5\n  session_sticky: false\n")
    cfg = build_config(parse(["--config", str(path)]), env={})
    assert cfg.policy_options() == {"prefill_lanes": 2, "load_weight": 0.5, "session_sticky": False}
    cfg = build_config(parse(["--config", str(path)]), env={"UNICACHE_ROUTING_OPTIONS": "prefill_lanes=8"})
    assert cfg.policy_options() == {"prefill_lanes": 8}  # the environment replaces the file's setting
    cfg = build_config(parse(["--routing-option", "evict_weight=0.25", "--routing-option", "track_inflight=true"]),
                       env={"UNICACHE_ROUTING_OPTIONS": '{"prefill_lanes": 3}'})
    assert cfg.policy_options() == {"prefill_lanes": 3, "evict_weight": 0.25, "track_inflight": True}
    policy = build_policy(cfg.routing_policy, None, cfg.policy_options())
    assert (policy.config.prefill_lanes, policy.config.evict_weight, policy.config.track_inflight) == (3, 0.25, True)
    assert policy.config.load_weight == 1.0  # the rest keep their defaults
    assert json.loads(cfg.routing_options) == {"prefill_lanes": 3, "evict_weight": 0.25, "track_inflight": True}


@pytest.mark.parametrize("options, message", [
    ("prefil_lanes=2", "routing_options: cache_aware has no setting prefil_lanes (its settings: load_weight,"),
    ("prefill_lanes=two", "routing_options: prefill_lanes must be int, got 'two'"),
    ('{"prefill_lanes": 2.5}', "routing_options: prefill_lanes must be int, got 2.5"),
    ("prefill_lanes=0", "routing_options: prefill_lanes must be >= 1, got 0"),
    ("admission_factor=0.5", "routing_options: admission_factor must be >= 1, got 0.5"),
    ("prefill_lanes", "routing_options: bad entry 'prefill_lanes': expected name=value"),
    ("[1]", "routing_options: bad entry '[1]'"),
    ('{"a": ', "routing_options: not a JSON object"),
])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(UsageError) as err:
        build_config(env={"UNICACHE_ROUTING_OPTIONS": options})
    assert str(err.value).startswith(message)


def test_a_policy_without_settings_refuses_options():
    with pytest.raises(UsageError, match="routing_options: routing policy 'round_robin' takes no settings"):
        build_config(env={"UNICACHE_ROUTING_POLICY": "round_robin", "UNICACHE_ROUTING_OPTIONS": "load_weight=1"})
