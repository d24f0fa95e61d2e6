"""The per-tenant prompt limit follows the fleet (router/request_path/limits.py FOLLOW_FLEET):
by default the longest context a backend reports (vLLM's ``/v1/models`` ``max_model_len``,
our replicas' heartbeats); an explicit setting, default or per tenant, still wins."""

from __future__ import annotations

import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.models import ModelCard, fleet_context
from unicache.router.cluster.view import ClusterView
from unicache.router.config import build_config
from unicache.router.request_path.limits import (
    FLEET_REFRESH_S,
    FLEET_UNKNOWN_PROMPT_TOKENS,
    FOLLOW_FLEET,
    LimitExceeded,
    TenantLimiter,
    TenantLimits,
    limiter_from_config,
)
from unicache.router.routing.registry import make_routing_policy
from unicache.v1 import cache_pb2


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Fleet:
    """A fleet context that counts its readings."""

    def __init__(self, context: int | None):
        self.context = context
        self.reads = 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.context


def refused(lim: TenantLimiter, tenant: str, n: int) -> str | None:
    try:
        lim.check_prompt(tenant, n)
    except LimitExceeded as exc:
        assert (exc.kind, exc.limit) == ("invalid", "max_prompt_tokens")
        return str(exc)
    return None


def test_the_default_setting_follows_the_fleet():
    assert build_config(env={}).tenant_max_prompt_tokens == FOLLOW_FLEET
    lim = limiter_from_config(1024, FOLLOW_FLEET, 0, "", fleet_context=Fleet(131072))
    assert refused(lim, "acme", 131072) is None  # 32,768 used to refuse this
    assert refused(lim, "acme", 131073) == (
        "prompt has 131073 tokens; tenant 'acme' may send at most 131072 (limit max_prompt_tokens: the backends' context)")


def test_while_no_backend_reports_a_context_the_old_default_holds():
    lim = TenantLimiter(TenantLimits(max_prompt_tokens=FOLLOW_FLEET), fleet_context=Fleet(None))
    assert FLEET_UNKNOWN_PROMPT_TOKENS == 32768
    assert refused(lim, "acme", 32768) is None
    assert refused(lim, "acme", 32769) is not None
    no_fleet = TenantLimiter(TenantLimits(max_prompt_tokens=FOLLOW_FLEET))  # no reader wired
    assert no_fleet.max_prompt_tokens("acme") == 32768


def test_an_explicit_setting_wins_default_or_per_tenant():
    fleet = Fleet(131072)
    lim = TenantLimiter(TenantLimits(max_prompt_tokens=2048), {"big": {"max_prompt_tokens": FOLLOW_FLEET},
                                                               "open": {"max_prompt_tokens": 0}}, fleet_context=fleet)
    assert (lim.max_prompt_tokens("acme"), lim.max_prompt_tokens("big"), lim.max_prompt_tokens("open")) == (2048, 131072, 0)
    assert refused(lim, "acme", 2049) == "prompt has 2049 tokens; tenant 'acme' may send at most 2048 (limit max_prompt_tokens)"
    assert refused(lim, "big", 100000) is None
    assert refused(lim, "open", 10**7) is None
    follow = TenantLimiter(TenantLimits(max_prompt_tokens=FOLLOW_FLEET), {"small": {"max_prompt_tokens": 512}}, fleet_context=fleet)
    assert (follow.max_prompt_tokens("small"), follow.max_prompt_tokens("acme")) == (512, 131072)


def test_the_fleet_is_read_at_most_once_per_refresh_and_changes_follow():
    clock, fleet = Clock(), Fleet(4096)
    lim = TenantLimiter(TenantLimits(max_prompt_tokens=FOLLOW_FLEET), clock=clock, fleet_context=fleet)
    assert [lim.max_prompt_tokens(t) for t in ("a", "b", "a")] == [4096, 4096, 4096]
    assert fleet.reads == 1
    fleet.context = 8192  # a backend with a longer context joined
    clock.t += FLEET_REFRESH_S / 2
    assert lim.max_prompt_tokens("a") == 4096 and fleet.reads == 1
    clock.t += FLEET_REFRESH_S / 2
    assert lim.max_prompt_tokens("a") == 8192 and fleet.reads == 2


def test_only_minus_one_is_below_zero():
    with pytest.raises(UsageError, match=r"max_prompt_tokens must be a non-negative integer \(or -1: the backends' context\), got -2"):
        TenantLimits(max_prompt_tokens=-2)
    with pytest.raises(UsageError, match="tokens_per_minute must be a non-negative integer, got -1"):
        TenantLimits(tokens_per_minute=-1)


def test_fleet_context_is_the_longest_a_backend_reports():
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    assert fleet_context(cluster) is None
    cluster.upsert("r0", "127.0.0.1:1", heartbeat=cache_pb2.Heartbeat(replica_id="r0", max_model_len=4096))
    cluster.upsert("r1", "127.0.0.1:2", heartbeat=cache_pb2.Heartbeat(replica_id="r1"))  # reports none
    cluster.upsert("static", "127.0.0.1:3", static=True)  # no heartbeat at all
    assert fleet_context(cluster) == 4096
    cluster.upsert("vllm-a", "127.0.0.1:4", static=True)
    cluster.models.set_backend("vllm-a", [ModelCard("llama", None, 16384), ModelCard("sql-lora", "llama", 99999)])
    assert fleet_context(cluster) == 16384  # the adapter's figure is not a base model's context
    cluster.models.set_backend("vllm-b", [ModelCard("llama", None, 8192)])
    assert fleet_context(cluster) == 16384
    cluster.models.drop_backend("vllm-a")
    assert fleet_context(cluster) == 8192


def test_the_router_wires_its_cluster_into_the_limit():
    from unicache.router.app import RouterApp

    cfg = build_config(env={"UNICACHE_USE_REDIS": "false", "UNICACHE_SALT_SECRET": "s", "UNICACHE_AUTH_ENABLED": "false"})
    app = RouterApp(cfg)
    assert app.core.limits.max_prompt_tokens("acme") == FLEET_UNKNOWN_PROMPT_TOKENS
    app.cluster.upsert("r0", "127.0.0.1:1", heartbeat=cache_pb2.Heartbeat(replica_id="r0", max_model_len=65536))
    app.core.limits._fleet = None  # the next reading, without waiting out the refresh
    assert app.core.limits.max_prompt_tokens("acme") == 65536
