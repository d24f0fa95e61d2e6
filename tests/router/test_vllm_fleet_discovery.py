"""vLLM backends found by DNS (router/upstream/vllm_fleet/fleet.py): what a resolved name becomes,
and followers that come and go with the addresses."""

from __future__ import annotations

import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.registry import make_routing_policy
from unicache.router.upstream.vllm_fleet.fleet import DnsDiscovery, VllmFleet
from unicache.router.upstream.vllm_fleet.http_stream import VllmClients
from unicache.router.upstream.vllm_fleet.spec import BackendSpec, parse_backend


def test_discovery_names_each_address_a_backend():
    d = DnsDiscovery("dns://vllm.ns.svc:8000?kv-events=5557&replay=5558&interval=2")
    assert (d.name, d.http_port, d.interval_s) == ("vllm.ns.svc", 8000, 2.0)
    assert d.spec("10.1.2.3") == BackendSpec("vllm-10.1.2.3-8000", "http://10.1.2.3:8000", "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert d.spec("fd00::1").url == "http://[fd00::1]:8000"
    for bad, words in [("http://vllm:8000", "expected dns://"), ("dns://vllm?kv-events=1", "expected dns://"),
                       ("dns://vllm:8000?events=1", "unknown: events"), ("dns://vllm:8000?interval=0", "interval must be positive")]:
        with pytest.raises(UsageError, match=words):
            DnsDiscovery(bad)


async def test_followers_follow_the_resolved_addresses_and_listed_ones_stay():
    answers = [["127.0.0.2", "127.0.0.3"], ["127.0.0.3"], OSError("no such name"), []]

    async def resolver(name, port):
        assert (name, port) == ("vllm", 1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    clients = VllmClients()
    listed = parse_backend("http://127.0.0.9:1,id=listed")
    fleet = VllmFleet(cluster, clients, 32, [listed], "dns://vllm:1?kv-events=2", resolver=resolver,
                      follower_kwargs={"health_interval_s": 30.0})
    fleet._add(listed)
    try:
        await fleet.refresh()
        assert sorted(fleet.followers) == ["listed", "vllm-127.0.0.2-1", "vllm-127.0.0.3-1"]
        await fleet.refresh()
        assert sorted(fleet.followers) == ["listed", "vllm-127.0.0.3-1"]
        await fleet.refresh()  # a failed resolution changes nothing
        assert sorted(fleet.followers) == ["listed", "vllm-127.0.0.3-1"]
        await fleet.refresh()  # the listed backend never leaves
        assert sorted(fleet.followers) == ["listed"]
    finally:
        for rid in list(fleet.followers):
            await fleet._stop(rid, remove=True)
        await clients.close()
