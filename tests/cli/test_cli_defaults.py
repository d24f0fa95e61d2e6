"""``unicache status`` and ``unicache demo`` find the local router with no flags."""

from __future__ import annotations

import pytest

from unicache.cli.local_cluster import ClusterSettings, Endpoints, print_ready
from unicache.cli.main import build_parser
from unicache.contract.endpoints import LOCAL_ROUTER, default_router
from unicache.router.config import RouterConfig


@pytest.mark.parametrize("command", ["status", "demo"])
def test_status_and_demo_default_to_the_local_router(command, monkeypatch):
    monkeypatch.delenv("UNICACHE_ROUTER", raising=False)
    assert build_parser().parse_args([command]).router == LOCAL_ROUTER == "127.0.0.1:50051"
    assert build_parser().parse_args([command, "--router", "10.0.0.5:6000"]).router == "10.0.0.5:6000"
    monkeypatch.setenv("UNICACHE_ROUTER", "router.svc:50051")
    assert build_parser().parse_args([command]).router == "router.svc:50051"


def test_the_local_router_is_where_up_and_router_serve_by_default():
    assert f"{ClusterSettings().host}:{ClusterSettings().grpc_port}" == LOCAL_ROUTER
    assert RouterConfig().grpc_port == ClusterSettings().grpc_port
    assert default_router({}) == LOCAL_ROUTER and default_router({"UNICACHE_ROUTER": "x:1"}) == "x:1"


def test_the_ready_banner_shows_router_flags_only_when_needed(capsys):
    print_ready(Endpoints(LOCAL_ROUTER, "http://127.0.0.1:8000", "redis://127.0.0.1:1", []), None)
    out = capsys.readouterr().out.splitlines()
    assert "  unicache status" in out and "  unicache demo" in out
    print_ready(Endpoints("127.0.0.1:41234", "http://127.0.0.1:8000", "redis://127.0.0.1:1", []), None)
    out = capsys.readouterr().out.splitlines()
    assert "  unicache status --router 127.0.0.1:41234" in out and "  unicache demo --router 127.0.0.1:41234" in out


async def test_the_banners_hello_prompt_hits_the_cache_when_sent_twice(one_replica_stack, capsys):
    """The first request a newcomer copies shows a cache hit on its second sending (a
    prompt shorter than one block, as "Hello, cache!" was, never hits)."""
    import httpx

    from unicache.cli.local_cluster import HELLO_PROMPT

    print_ready(Endpoints(LOCAL_ROUTER, "http://127.0.0.1:8000", "redis://127.0.0.1:1", []), None, model="tiny")
    banner = capsys.readouterr().out
    assert f'"model": "tiny", "prompt": "{HELLO_PROMPT}"' in banner and "run it twice" in banner
    body = {"model": "unicache-default", "prompt": HELLO_PROMPT, "max_tokens": 8}
    async with httpx.AsyncClient(base_url=one_replica_stack.http_url, headers={"x-api-key": "key-acme"}, timeout=30) as c:
        first = (await c.post("/v1/completions", json=body)).json()["usage"]
        second = (await c.post("/v1/completions", json=body)).json()["usage"]
    block = one_replica_stack.replicas[0].engine.block_size
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (second["prompt_tokens"] - 1) // block * block >= 2 * block
