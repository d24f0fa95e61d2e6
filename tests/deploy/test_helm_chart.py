"""Offline checks of the Helm chart in helm/unicache.

The chart is rendered with helm-python-sdk (Helm's Go SDK; no helm binary, no cluster) for
three value sets; every rendered manifest is validated with kubernetes-validate (strict:
unknown fields are errors), the RayCluster against the KubeRay CRD's own schema (vendored:
tests/schemas/kuberay), the ServiceMonitor by shape, and everything is scanned once by
checkov. Manifests are parsed with duplicate keys refused (tests/support/strict_yaml.py).
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from tests.support import strict_yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "unicache"
# The v1 RayCluster schema of KubeRay's CRD, vendored with its source and licence
# (tests/schemas/kuberay/README.md): a clone validates the chart without anything beside it.
RAYCLUSTER_SCHEMA = REPO / "tests" / "schemas" / "kuberay" / "raycluster-v1.openapi.json"
KUBE_VERSION = "1.33"
RELEASE = "uc"
NAMESPACE = "serving"

EXTERNAL_REDIS = {
    "redis": {
        "enabled": False,
        "external": {"url": "rediss://redis.example.internal:6380/2", "passwordSecret": "ext-redis"},
    },
    "monitoring": {"serviceMonitor": {"enabled": False}},
    "router": {"autoscaling": {"enabled": False}, "replicaCount": 3},
}
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
GPU4 = {
    "rayCluster": {
        "worker": {
            "replicas": 4,
            "gpusPerWorker": 1,
            "tolerations": GPU_TOLERATIONS,
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
        "image": {"digest": "sha256:" + "a" * 64},
    },
    "router": {"image": {"digest": "sha256:" + "b" * 64}},
    "redis": {"persistence": {"enabled": True, "size": "2Gi"}, "image": {"digest": "sha256:" + "c" * 64}},
    "auth": {"apiKeys": [{"key": "k-alpha", "tenant": "alpha"}, {"key": "k-beta", "tenant": "beta"}], "saltSecret": "s3cret",
             "clusterKey": "ck-given-0123456789abcdef", "adminKey": "adm-given-42"},
}
VALUE_SETS = {"default": {}, "external-redis": EXTERNAL_REDIS, "gpu4": GPU4}



def load_tool(stem: str):
    """A script of helm/tools (not a package) loaded as a module."""
    spec = importlib.util.spec_from_file_location(stem, REPO / "helm" / "tools" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DASHBOARD = load_tool("build_dashboard")


def render(values: dict, name: str = RELEASE) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=name, namespace=NAMESPACE, is_install=True)


def documents(rendered: dict[str, str]) -> list[tuple[str, dict]]:
    """(template path, manifest) for every non-empty YAML document."""
    out = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            out.extend((path, doc) for doc in strict_yaml.safe_load_all(text) if doc)
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[tuple[str, dict]]]:
    return {name: documents(render(values)) for name, values in VALUE_SETS.items()}


def find(docs, kind: str, component: str | None = None) -> list[dict]:
    return [
        d
        for _, d in docs
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def one(docs, kind: str, component: str | None = None) -> dict:
    found = find(docs, kind, component)
    assert len(found) == 1, f"expected one {kind}/{component}, got {len(found)}"
    return found[0]


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(label, pod spec) of every pod a manifest creates."""
    kind = doc["kind"]
    if kind in ("Deployment", "StatefulSet"):
        return [(kind, doc["spec"]["template"]["spec"])]
    if kind == "Pod":
        return [(kind, doc["spec"])]
    if kind == "RayCluster":
        out = [("RayCluster head", doc["spec"]["headGroupSpec"]["template"]["spec"])]
        out += [(f"RayCluster {g['groupName']}", g["template"]["spec"]) for g in doc["spec"]["workerGroupSpecs"]]
        return out
    return []


def container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --- values and schema ---------------------------------------------------------------


def test_values_every_key_has_a_doc_comment():
    """Every leaf key carries a `# --` comment, itself or on an enclosing key."""
    undocumented = []
    documented_indents: list[int] = []  # indents of enclosing keys that carry `# --`
    prev = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if not m:
            if line.strip() and not line.strip().startswith("#"):
                prev = line
            else:
                prev = line if line.strip() else prev
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        documented_indents = [i for i in documented_indents if i < indent]
        has_doc = prev.strip().startswith("# --") or bool(documented_indents)
        if rest == "":
            if prev.strip().startswith("# --"):
                documented_indents.append(indent)
        elif not has_doc:
            undocumented.append(key)
        prev = line
    assert undocumented == []


def test_schema_accepts_the_value_sets_and_rejects_bad_values():
    with helm.Chart.load(CHART) as chart:
        for values in VALUE_SETS.values():
            chart.validate_schema(values)
        bad = [
            {"router": {"replicaCount": "two"}},
            {"router": {"replicaCoun": 2}},
            {"router": {"image": {"tag": "latest"}}},
            {"redis": {"enabled": False}},
            {"auth": {"apiKeys": [{"key": "a,b", "tenant": "t"}]}},
            {"settings": {"extra": {"REDIS_URL": "x"}}},
            {"replicas": {"gpu": "maybe"}},
            {"redis": {"password": "p@ss/word"}},
        ]
        for values in bad:
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(values)


def test_helm_lint_reports_no_warnings_or_errors():
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- rendered resources --------------------------------------------------------------


def test_default_render_has_exactly_these_resources(rendered):
    names = sorted((d["kind"], d["metadata"]["name"]) for _, d in rendered["default"])
    assert names == [
        ("ConfigMap", "uc-unicache-dashboard"),
        ("ConfigMap", "uc-unicache-settings"),
        ("Deployment", "uc-unicache-launcher"),
        ("Deployment", "uc-unicache-router"),
        ("HorizontalPodAutoscaler", "uc-unicache-router"),
        ("NetworkPolicy", "uc-unicache-launcher"),
        ("NetworkPolicy", "uc-unicache-ray"),
        ("NetworkPolicy", "uc-unicache-redis"),
        ("NetworkPolicy", "uc-unicache-router"),
        ("Pod", "uc-unicache-test-router"),
        ("PodDisruptionBudget", "uc-unicache-router"),
        ("PodMonitor", "uc-unicache-replicas"),
        ("PrometheusRule", "uc-unicache-router"),
        ("RayCluster", "uc-unicache-ray"),
        ("Secret", "uc-unicache-redis"),
        ("Secret", "uc-unicache-secrets"),
        ("Secret", "uc-unicache-tls"),
        ("Service", "uc-unicache-redis"),
        ("Service", "uc-unicache-redis-headless"),
        ("Service", "uc-unicache-router"),
        ("ServiceMonitor", "uc-unicache-router"),
        ("StatefulSet", "uc-unicache-redis"),
    ]
    assert all(d["metadata"]["namespace"] == NAMESPACE for _, d in rendered["default"])


def test_templates_are_named_kind_dash_component(rendered):
    short = {"hpa": "horizontalpodautoscaler", "pdb": "poddisruptionbudget"}
    for path, doc in rendered["default"]:
        kind = Path(path).name.removesuffix(".yaml").split("-")[0]
        assert short.get(kind, kind) == doc["kind"].lower(), path


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_core_manifests_validate_strictly(rendered, value_set):
    checked = 0
    for path, doc in rendered[value_set]:
        if doc["kind"] in ("RayCluster", "ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute"):
            continue  # custom resources: checked against their own schemas below
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path}: {doc['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert checked >= 10


def _strict_crd_schema(schema: dict) -> dict:
    """The CRD's openAPIV3Schema with unknown fields rejected (as kubectl's strict field
    validation does), except where the CRD itself preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def raycluster_schema() -> dict:
    """The strict v1 RayCluster schema of the KubeRay CRD (the vendored copy)."""
    schema = _strict_crd_schema(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_raycluster_validates_against_the_kuberay_crd(rendered, raycluster_schema, value_set):
    doc = one(rendered[value_set], "RayCluster")
    assert doc["apiVersion"] == "ray.io/v1"
    errors = sorted(jsonschema.Draft7Validator(raycluster_schema).iter_errors(doc), key=lambda e: list(e.path))
    assert [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors] == []


def test_strict_crd_schema_rejects_a_misspelt_field(rendered, raycluster_schema):
    """The strict CRD check is not vacuous: a typo in the worker group fails it."""
    doc = copy.deepcopy(one(rendered["default"], "RayCluster"))
    doc["spec"]["workerGroupSpecs"][0]["replicaz"] = 3
    assert not jsonschema.Draft7Validator(raycluster_schema).is_valid(doc)


def test_servicemonitor_shape(rendered):
    sm = one(rendered["default"], "ServiceMonitor")
    svc = one(rendered["default"], "Service", "router")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert "http" in port_names
    assert re.fullmatch(r"\d+s", sm["spec"]["endpoints"][0]["interval"])
    assert find(rendered["external-redis"], "ServiceMonitor") == []


def test_podmonitor_scrapes_one_metrics_port_per_replica_actor_of_a_worker_pod():
    """Two GPUs per worker: two replica actors per pod, two declared metrics ports, the
    replicas told to bind the first free of them, both scraped and open to Prometheus."""
    docs = documents(render({"rayCluster": {"worker": {"gpusPerWorker": 2}}, "replicas": {"metricsPort": 9500}}))
    pm = one(docs, "PodMonitor")
    rc = one(docs, "RayCluster")
    worker = rc["spec"]["workerGroupSpecs"][0]["template"]
    [container] = worker["spec"]["containers"]
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("uc-metrics-0", 9500), ("uc-metrics-1", 9501)]
    assert pm["spec"]["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in pm["spec"]["podMetricsEndpoints"]] == [("uc-metrics-0", "/metrics"), ("uc-metrics-1", "/metrics")]
    settings = one(docs, "ConfigMap", "settings")["data"]
    assert (settings["UNICACHE_METRICS_PORT"], settings["UNICACHE_METRICS_PORT_SPAN"]) == ("9500", "2")
    ray_policy = one(docs, "NetworkPolicy", "ray")["spec"]["ingress"]
    assert [p["port"] for p in ray_policy[1]["ports"]] == [9500, 9501] and "from" not in ray_policy[1]
    from unicache.replica.settings import ReplicaSettings

    assert {"metrics_port", "metrics_port_span"} <= set(ReplicaSettings.__dataclass_fields__)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_has_probes_resources_and_a_locked_down_security_context(rendered, value_set):
    seen = []
    for _, doc in rendered[value_set]:
        is_hook = "helm.sh/hook" in doc["metadata"].get("annotations", {})
        for label, spec in pod_specs(doc):
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000, label
            assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, label
            assert spec["automountServiceAccountToken"] is False, label
            for c in spec["containers"]:
                seen.append(c["name"])
                if not is_hook:  # a run-to-completion test pod has nothing to probe
                    assert "livenessProbe" in c and "readinessProbe" in c, (label, c["name"])
                for part in ("requests", "limits"):
                    assert {"cpu", "memory"} <= c["resources"][part].keys(), (label, c["name"], part)
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, c["name"]
                assert sc["readOnlyRootFilesystem"] is True, c["name"]
                assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
    assert sorted(seen) == ["launcher", "ray-head", "ray-worker", "redis", "router", "test"] or (
        value_set == "external-redis" and sorted(seen) == ["launcher", "ray-head", "ray-worker", "router", "test"]
    )


def test_router_ports_probes_and_wiring(rendered):
    docs = rendered["default"]
    dep = one(docs, "Deployment", "router")
    svc = one(docs, "Service", "router")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["router", "--grpc-port", "50051", "--http-port", "8000", "--workers", "1"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("grpc", 50051, "grpc"),
        ("http", 8000, "http"),
    ]
    assert c["livenessProbe"]["grpc"] == {"port": 50051}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    env = container_env(c)
    assert env["UNICACHE_GRPC_HOST"]["value"] == "0.0.0.0"
    assert env["UNICACHE_API_KEYS_FILE"]["value"] == "/etc/unicache/secrets/api-keys"
    assert env["UNICACHE_SALT_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "uc-unicache-secrets", "key": "salt-secret"}
    assert env["UNICACHE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "uc-unicache-redis", "key": "redis-password"}
    assert env["UNICACHE_CLUSTER_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "uc-unicache-secrets", "key": "cluster-key"}
    assert "UNICACHE_ADMIN_KEY" not in env  # auth.adminKey unset: the admin endpoints stay open in-cluster
    assert env["UNICACHE_REDIS_URL"]["value"] == "rediss://:$(UNICACHE_REDIS_PASSWORD)@uc-unicache-redis.serving.svc:6379/0"
    names = [e["name"] for e in c["env"]]  # $(VAR) expands only variables defined earlier
    assert names.index("UNICACHE_REDIS_PASSWORD") < names.index("UNICACHE_REDIS_URL")
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    settings = one(docs, "ConfigMap", "settings")["data"]
    assert settings["UNICACHE_ROUTING_POLICY"] == "cache_aware"
    assert (settings["UNICACHE_BLOCK_SIZE"], settings["UNICACHE_NUM_BLOCKS"], settings["UNICACHE_GPU"]) == ("16", "1024", "auto")
    # empty settings mean "the default" to router and replicas alike, so they are not set at all
    assert "UNICACHE_TOKENIZER" not in settings and "UNICACHE_CHECKPOINT" not in settings
    assert "UNICACHE_REDIS_URL" not in settings  # per container: it embeds the password


@pytest.mark.parametrize(
    ("router", "expected", "shared"),
    [
        ({}, "on", True),  # the default: an HPA of 2 to 8 pods
        ({"autoscaling": {"enabled": False}, "replicaCount": 1}, "auto", False),  # one pod, one process
        ({"autoscaling": {"enabled": False}, "replicaCount": 3}, "on", True),
        ({"autoscaling": {"enabled": False}, "replicaCount": 1, "workers": 2}, "on", True),
        ({"sharedSessions": "off"}, "off", False),
        ({"autoscaling": {"enabled": False}, "replicaCount": 1, "sharedSessions": True}, "true", True),  # YAML's `on`
    ],
)
def test_shared_sessions_follow_the_router_process_count(router, expected, shared):
    from unicache.router.config import build_config, shares_sessions

    settings = one(documents(render({"router": router})), "ConfigMap", "settings")["data"]
    assert settings["UNICACHE_SHARED_SESSIONS"] == expected
    cfg = build_config(env={k: v for k, v in settings.items() if k.startswith("UNICACHE_")})
    assert shares_sessions(cfg) is shared


def test_router_limits_from_values_reach_the_router_config():
    docs = documents(render({"router": {"firstTokenTimeoutSeconds": 20, "retryReplicas": 1, "tenantLimits": {"maxConcurrent": 16},
                                        "tenantOverrides": ["acme.max_concurrent=4", "beta.tokens_per_minute=900"]}}))
    settings = one(docs, "ConfigMap", "settings")["data"]
    from unicache.router.config import build_config

    cfg = build_config(env={k: v for k, v in settings.items() if k.startswith("UNICACHE_")})
    assert (cfg.first_token_timeout_s, cfg.tenant_max_concurrent, cfg.tenant_max_prompt_tokens, cfg.tenant_tokens_per_minute) == (
        20.0, 16, -1, 0)
    assert (cfg.retry_replicas, cfg.first_token_timeout_floor_s, cfg.first_token_timeout_multiplier) == (1, 5.0, 3.0)
    assert (cfg.quarantine_initial_s, cfg.quarantine_max_s) == (0.5, 30.0)
    assert cfg.tenant_limits == "acme.max_concurrent=4,beta.tokens_per_minute=900"
    from unicache.router.request_path.limits import parse_tenant_limits

    assert parse_tenant_limits(cfg.tenant_limits) == {"acme": {"max_concurrent": 4}, "beta": {"tokens_per_minute": 900}}


def test_every_unicache_variable_the_chart_sets_is_a_real_setting(rendered):
    """UNICACHE_* names in the ConfigMap and container env are fields of RouterConfig or
    ReplicaSettings, or `unicache replicas` options (replica/cli.py): no typo is silently
    ignored by the programs."""
    from dataclasses import fields

    from unicache.replica.settings import ReplicaSettings
    from unicache.router.config import RouterConfig

    cli_options = re.findall(r"env_name\(['\"](\w+)['\"]\)", (REPO / "replica" / "cli.py").read_text())
    known = {"UNICACHE_" + n.upper() for n in [f.name for f in fields(RouterConfig)] + [f.name for f in fields(ReplicaSettings)] + cli_options}
    for value_set, docs in rendered.items():
        used = set(one(docs, "ConfigMap", "settings")["data"])
        for component in ("router", "launcher"):
            container = one(docs, "Deployment", component)["spec"]["template"]["spec"]["containers"][0]
            used |= {name for name in container_env(container) if name.startswith("UNICACHE_")}
        assert sorted(used - known) == [], value_set
        assert {"UNICACHE_REDIS_URL", "UNICACHE_SALT_SECRET", "UNICACHE_HOST", "UNICACHE_GPU"} <= used


def test_probe_paths_and_heartbeat_keys_match_the_code(rendered):
    """The chart's HTTP paths are routes of router/frontends/http_api.py, and the launcher's readiness
    probe counts heartbeats under the key pattern of unicache/contract/redis_keys.py."""
    from unicache.contract.redis_keys import RedisKeys

    routes = set(re.findall(r'Route\("([^"]+)"', (REPO / "router" / "frontends" / "http_api.py").read_text()))
    docs = rendered["default"]
    router = one(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    paths = {router[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe")}
    paths |= {e["path"] for e in one(docs, "ServiceMonitor")["spec"]["endpoints"]}
    paths |= set(re.findall(r'base \+ "([^"]+)"', one(docs, "Pod")["spec"]["containers"][0]["command"][2]))
    assert paths == {"/healthz", "/readyz", "/metrics", "/v1/models"}
    assert paths <= routes
    launcher = one(docs, "Deployment", "launcher")["spec"]["template"]["spec"]["containers"][0]
    probe = launcher["readinessProbe"]["exec"]["command"][2]
    assert 'os.environ["UNICACHE_REDIS_PREFIX"] + ":hb:*"' in probe
    assert RedisKeys("P").heartbeat_pattern() == "P" + ":hb:*"


def test_generated_secrets_are_well_formed(rendered):
    data = one(rendered["default"], "Secret", "secrets")["data"]
    keys = base64.b64decode(data["api-keys"]).decode()
    assert re.fullmatch(r"uc-[A-Za-z0-9]{40}:default\n", keys)
    assert re.fullmatch(r"[A-Za-z0-9]{48}", base64.b64decode(data["salt-secret"]).decode())
    assert re.fullmatch(r"[A-Za-z0-9]{64}", base64.b64decode(data["cluster-key"]).decode())
    assert "admin-key" not in data
    redis_data = one(rendered["default"], "Secret", "redis")["data"]
    password = base64.b64decode(redis_data["redis-password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    assert base64.b64decode(redis_data["redis.conf"]).decode() == f"requirepass {password}\n"


def test_given_secrets_are_used_verbatim(rendered):
    data = one(rendered["gpu4"], "Secret", "secrets")["data"]
    assert base64.b64decode(data["api-keys"]).decode() == "k-alpha:alpha\nk-beta:beta\n"
    assert base64.b64decode(data["salt-secret"]).decode() == "s3cret"
    assert base64.b64decode(data["cluster-key"]).decode() == "ck-given-0123456789abcdef"
    assert base64.b64decode(data["admin-key"]).decode() == "adm-given-42"
    router = one(rendered["gpu4"], "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    env = container_env(router)
    assert env["UNICACHE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "uc-unicache-secrets", "key": "admin-key"}
    [endpoint] = one(rendered["gpu4"], "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "uc-unicache-secrets", "key": "admin-key"}}


def test_external_redis_replaces_the_in_cluster_one(rendered):
    docs = rendered["external-redis"]
    assert find(docs, "StatefulSet") == [] and find(docs, "Secret", "redis") == []
    assert [d["metadata"]["name"] for d in find(docs, "Service")] == ["uc-unicache-router"]
    router = one(docs, "Deployment", "router")
    assert router["spec"]["replicas"] == 3 and find(docs, "HorizontalPodAutoscaler") == []
    for dep in (router, one(docs, "Deployment", "launcher")):
        env = container_env(dep["spec"]["template"]["spec"]["containers"][0])
        assert env["UNICACHE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ext-redis", "key": "redis-password"}
        assert env["UNICACHE_REDIS_URL"]["value"] == "rediss://:$(UNICACHE_REDIS_PASSWORD)@redis.example.internal:6380/2"


def test_gpu_worker_group_and_launcher(rendered):
    docs = rendered["gpu4"]
    rc = one(docs, "RayCluster")
    assert rc["spec"]["rayVersion"] == "2.52.1"
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("gpu-workers", 4, 1, 8)
    assert group["rayStartParams"] == {"num-gpus": "1"}
    spec = group["template"]["spec"]
    assert spec["tolerations"] == GPU_TOLERATIONS
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    worker = spec["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["image"] == "ghcr.io/unicache/unicache-replica@sha256:" + "a" * 64
    launcher = one(docs, "Deployment", "launcher")["spec"]["template"]["spec"]["containers"][0]
    assert launcher["command"] == ["unicache"]
    assert launcher["args"] == ["replicas", "--num", "4", "--ray-address", "ray://uc-unicache-ray-head-svc:10001"]
    assert launcher["image"] == worker["image"]  # Ray client and cluster must match versions
    env = container_env(launcher)
    assert env["UNICACHE_HOST"]["value"] == "0.0.0.0" and "UNICACHE_ADVERTISE_HOST" not in env
    # the launcher ships the cluster key to the replica actors (ReplicaSettings.cluster_key)
    assert env["UNICACHE_CLUSTER_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "uc-unicache-secrets", "key": "cluster-key"}
    redis = one(docs, "StatefulSet")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    # the default render has no GPU toleration or selector
    default_group = one(rendered["default"], "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "tolerations" not in default_group and "nodeSelector" not in default_group


def test_long_release_names_are_truncated_to_63_characters():
    name = "a-very-long-release-name-that-helm-still-accepts-53ch"  # Helm's maximum
    assert len(name) == 53
    docs = documents(render({}, name=name))
    for _, doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        assert not doc["metadata"]["name"].endswith("-")
        for value in doc["metadata"].get("labels", {}).values():
            assert len(str(value)) <= 63
    rc = one(docs, "RayCluster")
    assert len(rc["metadata"]["name"] + "-head-svc") <= 63


def test_grafana_dashboard_covers_cache_state_routing_and_ttft(rendered):
    cm = one(rendered["default"], "ConfigMap", "dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["unicache.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b(?:unicache_|vllm:)[a-z0-9_]+", e)}
    assert queried == set(DASHBOARD.METRICS) | set(DASHBOARD.REPLICA_METRICS)
    by_title = {p["title"]: p for p in dash["panels"]}
    for title, grouping, metric in [
        ("Cache hit ratio per replica", "by (replica)", "unicache_router_replica_hit_ratio"),
        ("KV blocks used per replica", "by (replica)", "unicache_router_replica_used_blocks"),
        ("KV blocks free per replica", "by (replica)", "unicache_router_replica_free_blocks"),
        ("Routing decisions by reason", "by (reason)", "unicache_router_routing_decisions_total"),
        ("Time to first token", "by (le)", "unicache_router_ttft_seconds_bucket"),
    ]:
        expr = by_title[title]["targets"][0]["expr"]
        assert grouping in expr and metric in expr, title


def test_committed_dashboard_matches_its_generator():
    assert (CHART / "dashboards" / "unicache.json").read_text() == DASHBOARD.render()


def test_router_exports_every_metric_the_dashboard_queries():
    """The dashboard's contract with router/observability/metrics.py: each queried series exists."""
    from unicache.router.observability.metrics import RouterMetrics

    suffix = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {
        family.name + s
        for family in RouterMetrics().registry.collect()
        for s in suffix.get(family.type, ("",))
    }
    assert sorted(set(DASHBOARD.METRICS) - exported) == []


def test_replicas_export_every_metric_the_dashboard_queries():
    """The replica panels' contract with replica/publishing/metrics.py (the torch engine's registry,
    after one request so every labelled series exists)."""
    from unicache.replica.engines.api import CacheStateInfo, EngineLoad, EngineOutput, Usage
    from unicache.replica.publishing.metrics import ReplicaMetrics

    class Engine:
        def load(self):
            return EngineLoad(0, 0, 0)

        def cache_state(self):
            return CacheStateInfo(16, 8, 0, 8, 0, 0.0, {"chat": 0}, "unicache", 0, queue_evictions={"chat": 0}, queue_hits={"chat": 0})

    metrics = ReplicaMetrics(Engine(), "m")
    timer = metrics.start_request()
    timer.output(EngineOutput("r", 0, [1], "a", True, "length", Usage(4, 0, 1)))
    timer.finish()
    suffix = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {f.name + s for f in metrics.registry.collect() for s in suffix.get(f.type, ("",))}
    assert sorted(set(DASHBOARD.REPLICA_METRICS) - exported) == []


def test_notes_render_the_quickstart():
    notes = render({})["unicache/templates/NOTES.txt"]
    assert "port-forward svc/uc-unicache-router 8000:8000 50051:50051" in notes
    assert "get secret uc-unicache-secrets" in notes
    assert "/v1/completions" in notes and "/dashboard" in notes


# --- checkov (one run per session: it is slow) ---------------------------------------


def run_checkov(value_sets: dict[str, dict], out: Path) -> list[dict]:
    """checkov's Kubernetes report on the chart rendered with each of ``value_sets``
    (written to ``out``, one file per set and template)."""
    for set_name, values in value_sets.items():
        for path, text in render(values).items():
            if path.endswith(".yaml") and text.strip():
                (out / f"{set_name}__{path.replace('/', '__')}").write_text(text)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("checkov")), "-d", str(out), "--framework", "kubernetes",
         "--output", "json", "--skip-download"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.stdout.strip(), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return report if isinstance(report, list) else [report]


@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory) -> list[dict]:
    return run_checkov(VALUE_SETS, tmp_path_factory.mktemp("rendered"))


def test_checkov_finds_no_failed_checks(checkov_report):
    failed = [
        (c["check_id"], c["resource"], c["file_path"])
        for r in checkov_report
        for c in r["results"]["failed_checks"]
    ]
    assert failed == []
    assert sum(r["summary"]["passed"] for r in checkov_report) > 500
    assert sum(r["summary"]["parsing_errors"] for r in checkov_report) == 0


def test_checkov_skips_are_each_justified(checkov_report):
    skipped = [c for r in checkov_report for c in r["results"]["skipped_checks"]]
    assert {c["check_id"] for c in skipped} <= {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_43"}
    for c in skipped:
        assert len(c["check_result"].get("suppress_comment", "")) > 20, c["check_id"]
    # with digests given (gpu4), the digest check runs and passes instead of being skipped
    assert not any(c["check_id"] == "CKV_K8S_43" and "gpu4__" in c["file_path"] for c in skipped)


def test_router_workers_value_reaches_the_command_line():
    docs = documents(render({"router": {"workers": 3, "replicaCount": 4, "autoscaling": {"enabled": False}}}))
    dep = one(docs, "Deployment", "router")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == "3"
    assert dep["spec"]["replicas"] == 4


# --- issue 38: duplicate keys, the served name, the vendored schema, vLLM on GPUs ---------


def test_rendered_manifests_are_parsed_with_duplicate_keys_refused():
    with pytest.raises(strict_yaml.DuplicateKeyError, match="found duplicate key 'UNICACHE_X'"):
        list(strict_yaml.safe_load_all("kind: ConfigMap\ndata:\n  UNICACHE_X: a\n  UNICACHE_X: b\n"))


@pytest.mark.parametrize(("values", "expected"), [
    ({}, "unicache-default"),  # the seeded model: settings.modelName
    ({"replicas": {"servedModelName": "chat"}}, "chat"),
    ({"replicas": {"engine": "vllm", "checkpoint": "/models/Qwen2.5-7B-Instruct/"}}, "Qwen2.5-7B-Instruct"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "w"}, "subPath": "llama-3-8b"}}, "llama-3-8b"),
    ({"replicas": {"servedModelName": "chat", "checkpoint": "/models/llama"}}, "chat"),
])
def test_the_served_model_name_is_written_once_as_the_replicas_name_it(values, expected):
    """One UNICACHE_SERVED_MODEL_NAME (a second was refused by strict parsers), and the name
    unicache/contract/model_name.py gives the replicas: the router serves what the replicas label."""
    from unicache.contract.model_name import served_model_name

    rendered = render(values)
    text = next(t for p, t in rendered.items() if p.endswith("configmap-settings.yaml"))
    assert text.count("UNICACHE_SERVED_MODEL_NAME:") == 1
    data = one(documents(rendered), "ConfigMap", "settings")["data"]
    assert data["UNICACHE_SERVED_MODEL_NAME"] == expected
    if data.get("UNICACHE_CHECKPOINT"):
        given = values.get("replicas", {}).get("servedModelName", "")
        assert served_model_name(given, data["UNICACHE_CHECKPOINT"]) == expected


def test_the_raycluster_schema_is_vendored_in_the_repository():
    assert RAYCLUSTER_SCHEMA.is_relative_to(REPO) and RAYCLUSTER_SCHEMA.is_file()
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    assert {"headGroupSpec", "workerGroupSpecs", "rayVersion"} <= set(schema["properties"]["spec"]["properties"])
    readme = (RAYCLUSTER_SCHEMA.parent / "README.md").read_text()
    assert "ray-project/kuberay" in readme and "Apache-2.0" in readme and "feeaf72" in readme


VLLM_GPU = {
    "replicas": {"engine": "vllm", "maxModelLen": 32768,
                 "vllm": {"gpuMemoryUtilization": 0.85, "tensorParallelSize": 2,
                          "args": {"kv_cache_dtype": "fp8", "enable_chunked_prefill": True}}},
    "model": {"source": "pvc", "pvc": {"claimName": "weights"}, "subPath": "Qwen2.5-72B-Instruct"},
    "rayCluster": {"worker": {"replicas": 2, "gpusPerWorker": 4}},
}


def test_vllm_gpu_values_reach_the_replica_settings(raycluster_schema):
    """The chart's vLLM keys become the replicas' settings (the ConfigMap's variables, read
    as the replica reads its environment), and the launcher runs one replica per TP group."""
    from unicache.plumbing import settings as settings_mod
    from unicache.replica.settings import ReplicaSettings

    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(VLLM_GPU)
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"replicas": {"vllm": {"tensorParallelSize": 0}}})
    docs = documents(render(VLLM_GPU))
    jsonschema.validate(one(docs, "RayCluster"), raycluster_schema)
    data = one(docs, "ConfigMap", "settings")["data"]
    s = settings_mod.build(ReplicaSettings, env={k: v for k, v in data.items() if k.startswith("UNICACHE_")})
    assert (s.engine, s.tensor_parallel_size, s.gpu_memory_utilization, s.num_blocks, s.max_model_len) == ("vllm", 2, 0.85, 0, 32768)
    engine = s.vllm_engine_values()
    assert engine["vllm_args"] == {"kv_cache_dtype": "fp8", "enable_chunked_prefill": True}
    assert (engine["tensor_parallel_size"], engine["gpu_memory_utilization"], engine["num_blocks"], engine["enforce_eager"]) == (2, 0.85, 0, False)
    # 2 workers x 4 GPUs, 2 GPUs per replica: 4 replica actors
    launcher = one(docs, "Deployment", "launcher")["spec"]["template"]["spec"]["containers"][0]
    assert launcher["args"][:3] == ["replicas", "--num", "4"]
    # the default (torch) render writes none of the vLLM keys
    default = one(documents(render({})), "ConfigMap", "settings")["data"]
    assert not {"UNICACHE_TENSOR_PARALLEL_SIZE", "UNICACHE_VLLM_ARGS", "UNICACHE_GPU_MEMORY_UTILIZATION"} & set(default)
