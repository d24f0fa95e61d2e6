"""vLLM backends found through the Kubernetes API (router/upstream/vllm_fleet/k8s_discovery.py):
the setting, what a slice's endpoints become, and the official client listing and watching
EndpointSlices on a stub API server (unicache/testing/k8s_api_stub.py) while the fleet's
followers come and go with the ready endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from kubernetes import client

from unicache.plumbing.errors import UsageError
from unicache.router.app import RouterApp
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.routing.registry import make_routing_policy
from unicache.router.upstream.vllm_fleet.fleet import VllmFleet, parse_discovery
from unicache.router.upstream.vllm_fleet.http_stream import VllmClients
from unicache.router.upstream.vllm_fleet.k8s_discovery import K8sDiscovery
from unicache.router.upstream.vllm_fleet.spec import BackendSpec
from unicache.testing.k8s_api_stub import EndpointSliceApi, endpoint, write_kubeconfig
from unicache.testing.polling import eventually

from tests.router.test_served_models import ModelsBackend, card
from tests.support.router_stack import config

PORTS = [("http", 8000), ("kv-events", 5557)]
LABELS = {"app": "vllm", "kubernetes.io/service-name": "vllm"}
SETTING = "k8s://serving?selector=app=vllm&port=http&kv-events=kv-events&replay=5558"


def test_the_setting_parses_and_refuses_by_name():
    d = parse_discovery(SETTING)
    assert isinstance(d, K8sDiscovery)
    assert (d.namespace, d.selector, d.port, d.events_port, d.replay_port) == ("serving", "app=vllm", "http", "kv-events", 5558)
    d = K8sDiscovery("k8s://?selector=app=vllm,tier!=canary&port=8000")
    assert (d.namespace, d.selector, d.port, d.events_port, d.replay_port) == ("", "app=vllm,tier!=canary", 8000, None, None)
    for bad, words in [("k8s://ns?port=http", "selector= is required"), ("k8s://ns?selector=app=vllm", "port= is required"),
                       ("k8s://ns?selector=a=b&port=1&events=2", "unknown: events"), ("k8s://ns:80?selector=a=b&port=1", "expected k8s://"),
                       ("kube://ns?selector=a=b&port=1", "expected dns://")]:
        with pytest.raises(UsageError, match=words):
            parse_discovery(bad)


def slice_of(endpoints: list[dict], ports=PORTS) -> client.V1EndpointSlice:
    """A slice as the client deserializes it."""
    api = client.ApiClient()
    raw = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4", "metadata": {"name": "s"},
           "endpoints": endpoints, "ports": [{"name": n, "port": p} for n, p in ports]}
    return api._ApiClient__deserialize(raw, "V1EndpointSlice")


def test_ready_endpoints_become_backends_named_by_their_pods():
    d = K8sDiscovery(SETTING)
    slices = {
        "a": slice_of([endpoint("10.0.0.1", "vllm-0"), endpoint("10.0.0.2", "vllm-1", ready=False),
                       endpoint("10.0.0.3", "vllm-2", ready=None), {"addresses": ["10.0.0.4"]}]),
        "b": slice_of([endpoint("10.0.0.9", "other")], ports=[("metrics", 9000)]),  # no http port: skipped
    }
    assert d.specs(slices) == {
        "vllm-0": BackendSpec("vllm-0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        "vllm-2": BackendSpec("vllm-2", "http://10.0.0.3:8000", "tcp://10.0.0.3:5557", "tcp://10.0.0.3:5558"),
        "vllm-10.0.0.4-8000": BackendSpec("vllm-10.0.0.4-8000", "http://10.0.0.4:8000", "tcp://10.0.0.4:5557", "tcp://10.0.0.4:5558"),
    }
    assert K8sDiscovery("k8s://?selector=a=b&port=8000").specs({"a": slice_of([endpoint("fd00::1", "v6")])}) == {
        "v6": BackendSpec("v6", "http://[fd00::1]:8000", "", "")}


@pytest.fixture
async def api(tmp_path, monkeypatch):
    """The stub API server in namespace "serving", and the kubeconfig naming it."""
    stub = await EndpointSliceApi("serving").start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(str(tmp_path / "kubeconfig"), stub.url, "stub-token", "serving"))
    try:
        yield stub
    finally:
        await stub.stop()


async def test_followers_follow_the_watched_slices(api):
    api.put("vllm-abc", [endpoint("127.0.0.2", "vllm-0"), endpoint("127.0.0.3", "vllm-1", ready=False)], PORTS, LABELS)
    api.put("other", [endpoint("127.0.0.9", "web-0")], PORTS, {"app": "web"})
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    clients = VllmClients()
    fleet = VllmFleet(cluster, clients, 32, [], "k8s://serving?selector=app=vllm&port=http&kv-events=kv-events",
                      follower_kwargs={"health_interval_s": 30.0})
    fleet.discovery.max_backoff_s = 0.2
    task = asyncio.create_task(fleet.run())

    async def followers(expected: list[str], why: str) -> None:
        await eventually(lambda: sorted(fleet.followers) == expected, why)

    try:
        await followers(["vllm-0"], "the listed slice's ready endpoint")
        assert fleet.followers["vllm-0"].spec == BackendSpec("vllm-0", "http://127.0.0.2:8000", "tcp://127.0.0.2:5557", "")
        first = api.requests[0]
        assert (first["kind"], first["query"]["labelSelector"], first["authorization"]) == ("list", "app=vllm", "Bearer stub-token")
        await eventually(lambda: api.watchers() == 1, "watching")
        api.put("vllm-abc", [endpoint("127.0.0.2", "vllm-0"), endpoint("127.0.0.3", "vllm-1")], PORTS, LABELS)
        await followers(["vllm-0", "vllm-1"], "a pod that became ready joins")
        api.put("vllm-def", [endpoint("127.0.0.4", "vllm-2")], PORTS, LABELS)
        await followers(["vllm-0", "vllm-1", "vllm-2"], "a new slice's pod joins")
        api.put("vllm-abc", [endpoint("127.0.0.2", "vllm-0", ready=False), endpoint("127.0.0.3", "vllm-1")], PORTS, LABELS)
        await followers(["vllm-1", "vllm-2"], "a pod no longer ready leaves")
        api.delete("vllm-def")
        await followers(["vllm-1"], "a deleted slice's pods leave")
        # The watch's version expires (410 Gone): the client lists again and resumes.
        api.expire()
        await eventually(lambda: [r["kind"] for r in api.requests].count("list") == 2 and api.watchers() == 1, "listed again")
        api.put("vllm-abc", [endpoint("127.0.0.5", "vllm-1")], PORTS, LABELS)
        await eventually(lambda: fleet.followers.get("vllm-1") and fleet.followers["vllm-1"].spec.url == "http://127.0.0.5:8000",
                         "a pod at a new address is followed there")
        # The API server goes away: the fleet keeps what it has, and resumes when it answers.
        api.drop_watchers()
        await asyncio.sleep(0.3)
        assert sorted(fleet.followers) == ["vllm-1"]
        api.put("vllm-ghi", [endpoint("127.0.0.6", "vllm-3")], PORTS, LABELS)
        await followers(["vllm-1", "vllm-3"], "the watch resumed")
        assert all(r["query"]["labelSelector"] == "app=vllm" for r in api.requests)
        assert "web-0" not in fleet.followers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await clients.close()


async def test_a_refused_or_unreachable_api_changes_nothing_and_says_why(api, caplog):
    api.put("vllm-abc", [endpoint("127.0.0.2", "vllm-0")], PORTS, LABELS)
    api.refuse = 403
    found: list[dict] = []

    async def reconcile(specs):
        found.append(specs)

    d = K8sDiscovery("k8s://serving?selector=app=vllm&port=http", max_backoff_s=0.1)
    task = asyncio.create_task(d.follow(reconcile))
    try:
        await eventually(lambda: len(api.requests) >= 3, "retried")
        assert found == []
        warnings = [r.getMessage() for r in caplog.records if r.name.endswith("k8s_discovery") and r.levelname == "WARNING"]
        assert warnings == ["backend discovery: EndpointSlices in namespace serving answered 403 Forbidden: the router's service "
                            "account needs get, list and watch on endpointslices.discovery.k8s.io; keeping the backends found so far "
                            "and retrying"]  # once, however many retries
        api.refuse = 0
        await eventually(lambda: found and list(found[-1]) == ["vllm-0"], "listed once allowed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_router_routes_to_the_pods_the_api_lists(api):
    """The router's own setting end to end: two pods (fake vLLM servers on loopback) are
    found through the stub API, join, serve requests, and one leaves when not ready."""
    a = await ModelsBackend([card("tiny")]).start()
    b = await ModelsBackend([card("tiny")]).start()
    slices = {"vllm-a": ("vllm-0", a), "vllm-b": ("vllm-1", b)}
    for name, (pod, backend) in slices.items():
        api.put(name, [endpoint("127.0.0.1", pod)], [("http", int(backend.url.rsplit(":", 1)[1]))], LABELS)
    app = RouterApp(config([], backend_discovery="k8s://serving?selector=app=vllm&port=http", served_model_name="tiny",
                           block_size=16))
    await app.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10)
    try:
        await eventually(lambda: sorted(app.cluster.replicas) == ["vllm-0", "vllm-1"], "both pods joined")
        seen = set()
        for _ in range(4):
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "one two", "max_tokens": 1}, headers={"x-api-key": "key-a"})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-unicache-replica"])
        assert seen == {"vllm-0", "vllm-1"} and len(a.bodies) == len(b.bodies) == 2
        api.put("vllm-b", [endpoint("127.0.0.1", "vllm-1", ready=False)], [("http", int(b.url.rsplit(":", 1)[1]))], LABELS)
        await eventually(lambda: sorted(app.cluster.replicas) == ["vllm-0"], "the pod no longer ready left")
    finally:
        await http.aclose()
        await app.stop()
        await a.stop()
        await b.stop()
