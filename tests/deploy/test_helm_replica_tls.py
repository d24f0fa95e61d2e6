"""The chart's mutual TLS between router and replicas (replicaTls, on by default):
certificates from an existing Secret or from cert-manager Certificates, mounted whole (renewals reach the
files) where the router and the replica actors read them, with the names unicache/plumbing/tls.py
checks. Rendered, then validated as the chart's other manifests are."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

from unicache.plumbing.tls import ANY_REPLICA_NAME, ROUTER_NAME, replica_dns_name
from tests.deploy.test_helm_chart import KUBE_VERSION, RELEASE, RAYCLUSTER_SCHEMA, _strict_crd_schema, documents, find, one, render

REPLICA_IDS = [f"{RELEASE}-replica-{i}" for i in range(3)]
BASE = {"replicas": {"count": 3}}
FROM_SECRET = {**BASE, "replicaTls": {"enabled": True, "source": "secret", "existingSecret": "uc-mtls"}}
FROM_CERT_MANAGER = {**BASE, "replicaTls": {"enabled": True, "source": "certManager",
                                            "certManager": {"issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}}}}


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def tls_volume(pod_spec: dict) -> dict:
    return next(v for v in pod_spec["volumes"] if v["name"] == "replica-tls")


def projected_files(volume: dict) -> dict[str, tuple[str, str]]:
    """{file name: (Secret name, key)} of a projected volume."""
    return {item["path"]: (src["secret"]["name"], item["key"]) for src in volume["projected"]["sources"] for item in src["secret"]["items"]}


def worker_pod(docs) -> dict:
    return one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]


@pytest.mark.parametrize("values", [FROM_SECRET, FROM_CERT_MANAGER], ids=["secret", "cert-manager"])
def test_router_and_replicas_read_their_certificates_where_the_settings_point(values):
    docs = documents(render(values))
    router = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    router_env = env(router["containers"][0])
    assert {k: v for k, v in router_env.items() if k.startswith("UNICACHE_REPLICA_TLS")} == {
        "UNICACHE_REPLICA_TLS_CA": "/etc/unicache/tls/ca.pem",
        "UNICACHE_REPLICA_TLS_CERT": "/etc/unicache/tls/router.pem",
        "UNICACHE_REPLICA_TLS_KEY": "/etc/unicache/tls/router-key.pem",
    }
    launcher_env = env(one(docs, "Deployment", "launcher")["spec"]["template"]["spec"]["containers"][0])
    assert {k: v for k, v in launcher_env.items() if k.startswith("UNICACHE_TLS")} == {
        "UNICACHE_TLS_CA": "/etc/unicache/tls/ca.pem",
        "UNICACHE_TLS_CERT": "/etc/unicache/tls/{replica_id}.pem",
        "UNICACHE_TLS_KEY": "/etc/unicache/tls/{replica_id}-key.pem",
    }
    assert launcher_env["UNICACHE_ID_PREFIX"] == f"{RELEASE}-replica"
    worker = worker_pod(docs)
    for pod in (router, worker):
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "replica-tls")
        assert mount == {"name": "replica-tls", "mountPath": "/etc/unicache/tls", "readOnly": True}  # whole, never subPath
        assert tls_volume(pod)["projected"]["defaultMode"] == 0o400
    assert sorted(projected_files(tls_volume(router))) == ["ca.pem", "router-key.pem", "router.pem"]
    replica_files = projected_files(tls_volume(worker))
    assert sorted(replica_files) == sorted(["ca.pem"] + [f"{rid}{s}" for rid in REPLICA_IDS for s in (".pem", "-key.pem")])
    if values is FROM_SECRET:
        assert projected_files(tls_volume(router)) == {
            "ca.pem": ("uc-mtls", "ca.crt"), "router.pem": ("uc-mtls", "router.crt"), "router-key.pem": ("uc-mtls", "router.key")}
        assert replica_files[f"{RELEASE}-replica-2-key.pem"] == ("uc-mtls", f"{RELEASE}-replica-2.key")
        assert find(docs, "Certificate") == []


def test_cert_manager_issues_one_certificate_per_replica_id_naming_it_as_the_router_checks():
    docs = documents(render(FROM_CERT_MANAGER))
    certs = find(docs, "Certificate")
    assert len(certs) == 1 + len(REPLICA_IDS)
    router = one(docs, "Certificate", "router")["spec"]
    assert router["dnsNames"] == [ROUTER_NAME] and router["usages"] == ["digital signature", "client auth"]
    assert router["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    by_secret = {c["spec"]["secretName"]: c["spec"] for c in find(docs, "Certificate", "replicas")}
    worker_files = projected_files(tls_volume(worker_pod(docs)))
    for rid in REPLICA_IDS:
        secret, key = worker_files[f"{rid}.pem"]
        spec = by_secret[secret]
        assert key == "tls.crt" and worker_files[f"{rid}-key.pem"] == (secret, "tls.key")
        assert spec["dnsNames"] == [replica_dns_name(rid), ANY_REPLICA_NAME]
        assert spec["uris"] == [f"unicache://replica/{rid}"] and spec["usages"] == ["digital signature", "server auth"]
        assert (spec["duration"], spec["renewBefore"], spec["privateKey"]["rotationPolicy"]) == ("2160h", "360h", "Always")
    router_files = projected_files(tls_volume(one(docs, "Deployment", "router")["spec"]["template"]["spec"]))
    assert router_files["router.pem"] == (router["secretName"], "tls.crt")
    for cert in certs:  # the fields cert-manager's v1 Certificate requires, and names Kubernetes accepts
        assert cert["apiVersion"] == "cert-manager.io/v1" and {"secretName", "issuerRef"} <= set(cert["spec"])
        assert len(cert["metadata"]["name"]) <= 63 and len(cert["spec"]["secretName"]) <= 63


@pytest.mark.parametrize("values", [FROM_SECRET, FROM_CERT_MANAGER], ids=["secret", "cert-manager"])
def test_tls_manifests_validate_strictly(values):
    docs = documents(render(values))
    schema = _strict_crd_schema(__import__("json").loads(RAYCLUSTER_SCHEMA.read_text()))
    schema["properties"]["metadata"] = {"type": "object"}
    for path, doc in docs:
        if doc["kind"] == "RayCluster":
            jsonschema.validate(doc, schema)
        elif doc["kind"] in ("Deployment", "StatefulSet", "Service", "Secret", "ConfigMap"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_missing_sources_are_refused_at_render_time():
    with pytest.raises(Exception, match="replicaTls.existingSecret is required"):
        render({"replicaTls": {"enabled": True, "source": "secret"}})
    with pytest.raises(Exception, match="replicaTls.certManager.issuerRef.name is required"):
        render({"replicaTls": {"enabled": True, "source": "certManager"}})


def test_on_by_default_from_certificates_the_chart_issues():
    """No Secret and no issuer given: the chart's own (tests/deploy/test_helm_tls_default.py)."""
    docs = documents(render({}))
    assert find(docs, "Certificate") == []
    router = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert {s["secret"]["name"] for s in tls_volume(router)["projected"]["sources"]} == {f"{RELEASE}-unicache-tls"}
    assert env(router["containers"][0])["UNICACHE_REPLICA_TLS_CERT"] == "/etc/unicache/tls/router.pem"
