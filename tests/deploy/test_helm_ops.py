"""The chart's operations values: policy enums from the registries, images that exist,
model weights, autoscaling, Ingress / HTTPRoute and alert rules.

Rendered with helm-python-sdk and validated with kubernetes-validate (strict) and the
KubeRay CRD schema, as tests/deploy/test_helm_chart.py does.
"""

from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from unicache.replica.settings import replica_eviction_policies
from unicache.router.routing.registry import routing_policy_names
from tests.deploy.test_helm_chart import CHART, KUBE_VERSION, NAMESPACE, documents, find, one, raycluster_schema, render  # noqa: F401 - a fixture

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

PVC_MODEL = {"model": {"source": "pvc", "pvc": {"claimName": "llama-weights"}, "subPath": "llama-3-8b"}}
INIT_MODEL = {"model": {"source": "initContainer", "initContainer": {
    "image": {"repository": "registry.example.com/weights", "tag": "llama-3-8b"},
    "command": ["sh", "-c", "cp -r /weights/. \"$MODEL_DIR\"/"]}}}
HOSTPATH_MODEL = {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/llama"}}}
EXPOSED = {"router": {"ingress": {"enabled": True, "className": "nginx", "hosts": ["unicache.example.com"],
                                  "tls": [{"secretName": "unicache-tls", "hosts": ["unicache.example.com"]}]},
                      "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway"}],
                                    "hostnames": ["unicache.example.com"]}}}


def test_schema_policy_enums_equal_the_registries():
    assert SCHEMA["properties"]["router"]["properties"]["routingPolicy"]["enum"] == routing_policy_names()
    assert SCHEMA["properties"]["replicas"]["properties"]["evictionPolicy"]["enum"] == replica_eviction_policies()
    assert "opt" not in replica_eviction_policies()  # needs the future: simulator only
    with helm.Chart.load(CHART) as chart:
        for bad in ({"replicas": {"evictionPolicy": "mru"}}, {"replicas": {"evictionPolicy": "opt"}},
                    {"router": {"routingPolicy": "random"}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)
        chart.validate_schema({"replicas": {"evictionPolicy": "radix-lru"}, "router": {"routingPolicy": "sglang"}})


def test_project_images_default_to_the_app_version_and_pull_if_not_present():
    docs = documents(render({}))
    images = {}
    for _, d in docs:
        spec = d.get("spec", {})
        pods = []
        if d["kind"] in ("Deployment", "StatefulSet"):
            pods.append(spec["template"]["spec"])
        elif d["kind"] == "Pod":
            pods.append(spec)
        elif d["kind"] == "RayCluster":
            pods.append(spec["headGroupSpec"]["template"]["spec"])
            pods += [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            for c in pod["containers"]:
                images[c["image"]] = c["imagePullPolicy"]
    assert images == {
        f"ghcr.io/unicache/unicache-router:{APP_VERSION}": "IfNotPresent",
        f"ghcr.io/unicache/unicache-replica:{APP_VERSION}": "IfNotPresent",
        "docker.io/library/redis:7.4.2-alpine": "IfNotPresent",
    }
    pinned = documents(render({"router": {"image": {"tag": "0.0.9"}}}))
    router = one(pinned, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == "ghcr.io/unicache/unicache-router:0.0.9"


def test_worker_group_autoscaling_follows_min_and_max(raycluster_schema):
    doc = one(documents(render({"rayCluster": {"worker": {"minReplicas": 1, "replicas": 1, "maxReplicas": 6}}})), "RayCluster")
    jsonschema.validate(doc, raycluster_schema)
    spec = doc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["upscalingMode"] == "Default"
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 300
    group = spec["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 1, 6)
    off = one(documents(render({"rayCluster": {"autoscaling": {"enabled": False}}})), "RayCluster")
    assert off["spec"]["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in off["spec"]


def test_the_router_has_an_hpa():
    hpa = one(documents(render({})), "HorizontalPodAutoscaler")
    kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "uc-unicache-router"


def pod(docs, kind, component=None, group=0):
    d = one(docs, kind, component)
    if kind == "RayCluster":
        return d["spec"]["workerGroupSpecs"][group]["template"]["spec"]
    return d["spec"]["template"]["spec"]


@pytest.mark.parametrize("values, volume, checkpoint", [
    (PVC_MODEL, {"name": "model", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}, "/models/llama-3-8b"),
    (HOSTPATH_MODEL, {"name": "model", "hostPath": {"path": "/mnt/models/llama", "type": "Directory"}}, "/models"),
    (INIT_MODEL, {"name": "model", "emptyDir": {"sizeLimit": "50Gi"}}, "/models"),
])
def test_model_weights_reach_workers_and_router(values, volume, checkpoint, raycluster_schema):
    docs = documents(render(values))
    for _, d in docs:
        if d["kind"] not in ("RayCluster", "ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute"):
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
    jsonschema.validate(one(docs, "RayCluster"), raycluster_schema)
    settings = next(d for d in find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-settings"))
    assert settings["data"]["UNICACHE_CHECKPOINT"] == checkpoint
    for spec in (pod(docs, "RayCluster"), pod(docs, "Deployment", "router")):
        assert [v for v in spec["volumes"] if v["name"] == "model"] == [volume]
        mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]
        inits = [c["name"] for c in spec.get("initContainers", [])]
        assert inits == (["fetch-model"] if values is INIT_MODEL else [])
    if values is INIT_MODEL:
        init = pod(docs, "RayCluster")["initContainers"][0]
        assert init["image"] == "registry.example.com/weights:llama-3-8b"
        assert {"name": "MODEL_DIR", "value": "/models"} in init["env"]


def test_no_model_source_keeps_the_seeded_model():
    docs = documents(render({}))
    settings = next(d for d in find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-settings"))
    assert "UNICACHE_CHECKPOINT" not in settings["data"]
    assert all(v["name"] != "model" for v in pod(docs, "RayCluster")["volumes"])


def test_model_values_are_checked():
    with helm.Chart.load(CHART) as chart:
        for values in (PVC_MODEL, INIT_MODEL, HOSTPATH_MODEL):
            chart.validate_schema(values)
        for bad in ({"model": {"source": "s3"}}, {"model": {"source": "pvc"}},
                    {"model": {"source": "initContainer", "initContainer": {"image": {"repository": "x"}}}},
                    {"model": {"source": "hostPath", "hostPath": {"path": "relative"}}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_optional_ingress_and_httproute():
    docs = documents(render(EXPOSED))
    ingress = one(docs, "Ingress")
    kubernetes_validate.validate(ingress, KUBE_VERSION, strict=True)
    rule = ingress["spec"]["rules"][0]
    assert rule["host"] == "unicache.example.com" and ingress["spec"]["ingressClassName"] == "nginx"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "uc-unicache-router", "port": {"name": "http"}}
    route = one(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateway"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "uc-unicache-router", "port": 8000}]
    assert find(documents(render({})), "Ingress") == [] and find(documents(render({})), "HTTPRoute") == []
    with helm.Chart.load(CHART) as chart:
        for bad in ({"router": {"ingress": {"enabled": True}}}, {"router": {"httpRoute": {"enabled": True}}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_prometheus_rule_alerts_on_replica_down_hit_ratio_and_ttft():
    rule = one(documents(render({"monitoring": {"prometheusRule": {"ttftSloSeconds": 1.5, "labels": {"release": "kps"}}}})),
               "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert sorted(rules) == ["UniCacheHitRatioDrop", "UniCacheInsecureTransport", "UniCacheReplicaDown", "UniCacheTTFTSLOBreach"]
    assert rules["UniCacheInsecureTransport"]["expr"] == 'max(unicache_router_insecure_transport{namespace="%s"}) > 0' % NAMESPACE
    assert "unicache_router_replicas" in rules["UniCacheReplicaDown"]["expr"]
    assert "unicache_router_replica_hit_ratio" in rules["UniCacheHitRatioDrop"]["expr"]
    ttft = rules["UniCacheTTFTSLOBreach"]["expr"]
    assert ttft.startswith("histogram_quantile(0.99, ") and "unicache_router_ttft_seconds_bucket" in ttft
    assert ttft.endswith("> 1.5")
    assert all(r["for"] == "5m" and r["labels"] == {"severity": "warning"} for r in rules.values())
    assert find(documents(render({"monitoring": {"prometheusRule": {"enabled": False}}})), "PrometheusRule") == []


def test_alert_metrics_are_exported_by_the_router():
    from prometheus_client import generate_latest

    from unicache.router.observability.metrics import RouterMetrics

    text = generate_latest(RouterMetrics().registry).decode()
    for name in ("unicache_router_replicas", "unicache_router_ttft_seconds_bucket", "unicache_router_insecure_transport"):
        assert f"\n{name}" in text or text.startswith(name), name
    assert "unicache_router_replica_hit_ratio" in text
