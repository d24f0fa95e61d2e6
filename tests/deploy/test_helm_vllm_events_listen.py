"""The chart's `backends.vllm.publishToRouter` (issue 46): the vLLM pods publish their KV
events to the router's `--kv-events-listen` socket (a host endpoint: vLLM connects), each
on its pod name, which is its backend id; only one router process may hold that socket."""

from __future__ import annotations

import json

import pytest

from tests.deploy.test_helm_backends import MODEL, router_config, router_container
from tests.deploy.test_helm_chart import NAMESPACE, container_env, documents, one, render

ONE_ROUTER = {"autoscaling": {"enabled": False}, "replicaCount": 1}
LISTEN = {**MODEL, "backends": {"mode": "vllm", "vllm": {"replicas": 2, "publishToRouter": True, "routerEventsPort": 6001}},
          "router": ONE_ROUTER}


@pytest.fixture(scope="module")
def docs():
    return documents(render(LISTEN))


def test_the_pods_publish_to_the_router_on_their_own_names(docs):
    sts = one(docs, "StatefulSet", "vllm")
    [c] = sts["spec"]["template"]["spec"]["containers"]
    events = json.loads(c["args"][c["args"].index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "replay_endpoint": "tcp://*:5558",
                      "endpoint": f"tcp://uc-unicache-router.{NAMESPACE}.svc.cluster.local:6001", "topic": "$(POD_NAME)"}
    assert container_env(c)["POD_NAME"] == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def test_the_router_listens_and_lists_each_pod_by_its_topic(docs):
    cfg = router_config(docs)
    assert cfg.kv_events_listen == "tcp://*:6001"
    hosts = [f"uc-unicache-vllm-{i}.uc-unicache-vllm-headless.{NAMESPACE}.svc.cluster.local" for i in range(2)]
    assert [(b.backend_id, b.url, b.events, b.replay, b.topic) for b in cfg.backend_specs()] == [
        (f"uc-unicache-vllm-{i}", f"http://{h}:8000", "", f"tcp://{h}:5558", "") for i, h in enumerate(hosts)]
    assert ("kv-events", 6001) in [(p["name"], p["containerPort"]) for p in router_container(docs)["ports"]]
    svc = one(docs, "Service", "router")
    assert ("kv-events", 6001, "kv-events") in [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]]


def test_only_the_vllm_pods_reach_the_routers_events_port(docs):
    policy = one(docs, "NetworkPolicy", "router")
    [front, events] = policy["spec"]["ingress"]
    svc = one(docs, "Service", "router")
    assert [p["port"] for p in front["ports"]] == [p["port"] for p in svc["spec"]["ports"] if p["name"] in ("grpc", "http")]
    assert events["ports"] == [{"port": 6001, "protocol": "TCP"}]
    [peer] = events["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"


def test_without_it_the_router_connects_to_each_pod_as_before():
    docs = documents(render({**MODEL, "backends": {"mode": "vllm"}, "router": ONE_ROUTER}))
    cfg = router_config(docs)
    assert cfg.kv_events_listen == "" and all(b.events.endswith(":5557") for b in cfg.backend_specs())
    assert "kv-events" not in [p["name"] for p in router_container(docs)["ports"]]


@pytest.mark.parametrize("router", [{"autoscaling": {"enabled": True}}, {**ONE_ROUTER, "replicaCount": 2}, {**ONE_ROUTER, "workers": 2}])
def test_more_than_one_router_process_is_refused(router):
    with pytest.raises(Exception, match="publishToRouter needs one router process"):
        render({**LISTEN, "router": router})
