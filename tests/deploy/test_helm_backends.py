"""The chart's `backends.mode` (issue 35): `ray` (the RayCluster, the default), `vllm` (a
StatefulSet of stock `vllm serve` pods with UniCache's scheduler inside) and `external` (a
vLLM fleet the user runs). Rendered with helm-python-sdk, parsed with duplicate keys
refused, validated strictly with kubernetes-validate and scanned by checkov, as
tests/deploy/test_helm_chart.py does for the default value sets; the router's settings are read
back with the router's own config code, so what the chart writes is what the router takes.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_helm_chart import CHART, KUBE_VERSION, NAMESPACE, REPO, container_env, documents, find, one, pod_specs, render, run_checkov

MODEL = {"model": {"source": "pvc", "pvc": {"claimName": "weights"}, "subPath": "Qwen2.5-7B-Instruct"}}
VLLM = {
    **MODEL,
    "backends": {"mode": "vllm", "vllm": {"replicas": 3, "tensorParallelSize": 2, "evictionPolicy": "lru",
                                          "gpuMemoryUtilization": 0.85, "maxModelLen": 32768,
                                          "extraArgs": ["--kv-cache-dtype", "fp8"],
                                          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
    "settings": {"blockSize": 32},
}
# One router process: nothing to share sessions with, so no Redis at all.
VLLM_ONE_ROUTER = {**MODEL, "backends": {"mode": "vllm"}, "router": {"autoscaling": {"enabled": False}, "replicaCount": 1}}
FLEET = [
    {"url": "http://vllm-a.fleet.svc:8000", "kvEvents": "tcp://vllm-a.fleet.svc:5557", "replay": "tcp://vllm-a.fleet.svc:5558", "id": "a"},
    {"url": "http://vllm-b.fleet.svc:8000/", "kvEvents": "tcp://vllm-b.fleet.svc:5557"},
]
EXTERNAL = {"backends": {"mode": "external", "external": {"urls": FLEET}}, "settings": {"tokenizer": "/models/tok/tokenizer.json"}}
EXTERNAL_SELECTOR = {"backends": {"mode": "external", "external": {"selector": {"app": "vllm", "tier": "gpu"}, "namespace": "fleet"}}}
MODE_SETS = {"vllm": VLLM, "vllm-one-router": VLLM_ONE_ROUTER, "external": EXTERNAL, "external-selector": EXTERNAL_SELECTOR}
VLLM_KINDS = {"StatefulSet", "Service", "NetworkPolicy"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[tuple[str, dict]]]:
    out = {name: documents(render(values)) for name, values in MODE_SETS.items()}
    out["ray"] = documents(render({}))
    return out


def router_container(docs) -> dict:
    return one(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]


def router_config(docs):
    """The RouterConfig the router builds from the chart's ConfigMap and plain env values."""
    from unicache.router.config import build_config

    env = {k: v for k, v in one(docs, "ConfigMap", "settings")["data"].items() if k.startswith("UNICACHE_")}
    env |= {n: e["value"] for n, e in container_env(router_container(docs)).items() if "value" in e}
    return build_config(env=env)


# --- values and schema ---------------------------------------------------------------


def test_schema_mode_enum_and_bad_backend_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    backends = schema["properties"]["backends"]
    assert backends["properties"]["mode"]["enum"] == ["ray", "vllm", "external"]
    from unicache.replica.engines.vllm.config import LIVE_UNSUPPORTED, NATIVE_POLICY, policy_names

    # the policies UniCache's scheduler accepts inside vLLM (replica/engines/vllm/config.py)
    assert backends["properties"]["vllm"]["properties"]["evictionPolicy"]["enum"] == sorted(set(policy_names()) - LIVE_UNSUPPORTED) + [NATIVE_POLICY]
    with helm.Chart.load(CHART) as chart:
        for values in MODE_SETS.values():
            chart.validate_schema(values)
        chart.validate_schema({"backends": {"mode": "external", "external": {"dnsDiscovery": "dns://vllm.fleet.svc:8000?kv-events=5557"}}})
        for bad in (
            {"backends": {"mode": "k8s"}},
            {"backends": {"mode": "external"}},  # an external fleet needs urls, a selector or DNS discovery
            {"backends": {"mode": "external", "external": {"urls": [{"url": "http://a:8000/v1"}]}}},  # no path
            {"backends": {"mode": "external", "external": {"urls": [{"url": "http://a:8000", "kvEvents": "a:5557"}]}}},
            {"backends": {"mode": "external", "external": {"urls": [{"kvEvents": "tcp://a:5557"}]}}},
            {"backends": {"mode": "external", "external": {"dnsDiscovery": "vllm.fleet.svc:8000"}}},
            {"backends": {"vllm": {"evictionPolicy": "opt"}}},
            {"backends": {"vllm": {"replicas": 0}}},
            {"backends": {"vllm": {"kvEventsPort": 70000}}},
            {"backends": {"vllm": {"image": {"tag": "latest"}}}},
        ):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_the_selector_and_dns_discovery_are_one_or_the_other():
    both = {"backends": {"mode": "external", "external": {"selector": {"app": "vllm"}, "dnsDiscovery": "dns://vllm.fleet.svc:8000"}}}
    with pytest.raises(Exception, match="give selector or dnsDiscovery, not both"):
        render(both)
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({"backends": {"external": {"selectorPorts": {"http": "http", "kvEvents": 5557, "replay": ""}}}})
        for bad in ({"http": "HTTP"}, {"http": ""}, {"events": "5557"}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema({"backends": {"external": {"selectorPorts": bad}}})


# --- ray (the default) --------------------------------------------------------------------


def test_ray_mode_has_no_vllm_objects(rendered):
    docs = rendered["ray"]
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for _, d in docs}
    assert "vllm" not in components
    assert not find(docs, "Role") and not find(docs, "RoleBinding") and not find(docs, "ServiceAccount")
    assert [d["metadata"]["name"] for d in find(docs, "StatefulSet")] == ["uc-unicache-redis"]
    data = one(docs, "ConfigMap", "settings")["data"]
    assert not {"UNICACHE_BACKENDS", "UNICACHE_USE_REDIS", "UNICACHE_BACKEND_DISCOVERY"} & set(data)
    assert "UNICACHE_BACKEND_SELECTOR" not in container_env(router_container(docs))
    one(docs, "RayCluster"), one(docs, "Deployment", "launcher"), one(docs, "PodMonitor")


# --- every mode ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode_set", sorted(MODE_SETS))
def test_each_mode_validates_strictly_and_names_templates_kind_component(rendered, mode_set):
    short = {"hpa": "horizontalpodautoscaler", "pdb": "poddisruptionbudget"}
    kinds = set()
    for path, doc in rendered[mode_set]:
        assert short.get(Path(path).name.split("-")[0], Path(path).name.split("-")[0]) == doc["kind"].lower(), path
        kinds.add(doc["kind"])
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue  # custom resources: checked in tests/deploy/test_helm_chart.py
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path}: {doc['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")
    # no Ray objects outside ray mode
    assert not {"RayCluster", "PodMonitor"} & kinds
    assert find(rendered[mode_set], "Deployment", "launcher") == []
    assert not [d for _, d in rendered[mode_set] if d["metadata"]["labels"].get("app.kubernetes.io/component", "").startswith("ray")]


@pytest.mark.parametrize("mode_set", sorted(MODE_SETS))
def test_helm_lint_is_clean_in_each_mode(mode_set):
    report = helm.lint(CHART, MODE_SETS[mode_set], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("mode_set", sorted(MODE_SETS))
def test_each_mode_locks_down_every_container(rendered, mode_set):
    for _, doc in rendered[mode_set]:
        is_hook = "helm.sh/hook" in doc["metadata"].get("annotations", {})
        for label, spec in pod_specs(doc):
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False, label
            for c in spec["containers"]:
                assert is_hook or ("livenessProbe" in c and "readinessProbe" in c), (label, c["name"])
                sc = c["securityContext"]
                assert (sc["allowPrivilegeEscalation"], sc["readOnlyRootFilesystem"], sc["capabilities"]) == (False, True, {"drop": ["ALL"]})


@pytest.mark.parametrize("mode_set", sorted(MODE_SETS))
def test_every_unicache_variable_is_a_router_setting(rendered, mode_set):
    from unicache.router.config import RouterConfig

    known = {"UNICACHE_" + f.name.upper() for f in fields(RouterConfig)}
    docs = rendered[mode_set]
    used = {n for n in container_env(router_container(docs)) if n.startswith("UNICACHE_")}
    used |= {n for n in one(docs, "ConfigMap", "settings")["data"] if n.startswith("UNICACHE_")} - {
        # replica settings the shared ConfigMap carries in every mode (tests/deploy/test_helm_chart.py checks them)
        n for n in one(rendered["ray"], "ConfigMap", "settings")["data"]}
    assert sorted(used - known) == []
    assert {"UNICACHE_BACKENDS", "UNICACHE_USE_REDIS"} <= used


def test_notes_name_the_mode():
    assert 'backends  mode "ray"' in render({})["unicache/templates/NOTES.txt"]
    notes = render(VLLM)["unicache/templates/NOTES.txt"]
    assert 'backends  mode "vllm"' in notes and "rollout status statefulset/uc-unicache-vllm" in notes
    assert "rollout status deploy/uc-unicache-launcher" not in notes
    notes = render(EXTERNAL_SELECTOR)["unicache/templates/NOTES.txt"]
    assert 'backends  mode "external"' in notes and "selector  app=vllm,tier=gpu: the routers watch the EndpointSlices" in notes
    assert "redis     none" in render(VLLM_ONE_ROUTER)["unicache/templates/NOTES.txt"]


# --- vllm -------------------------------------------------------------------------------------


def test_vllm_mode_renders_exactly_these_resources(rendered):
    names = sorted((d["kind"], d["metadata"]["name"]) for _, d in rendered["vllm"])
    assert names == [
        ("ConfigMap", "uc-unicache-dashboard"),
        ("ConfigMap", "uc-unicache-settings"),
        ("Deployment", "uc-unicache-router"),
        ("HorizontalPodAutoscaler", "uc-unicache-router"),
        ("NetworkPolicy", "uc-unicache-redis"),
        ("NetworkPolicy", "uc-unicache-router"),
        ("NetworkPolicy", "uc-unicache-test"),
        ("NetworkPolicy", "uc-unicache-vllm"),
        ("Pod", "uc-unicache-test-router"),
        ("PodDisruptionBudget", "uc-unicache-router"),
        ("PrometheusRule", "uc-unicache-router"),
        ("Secret", "uc-unicache-redis"),
        ("Secret", "uc-unicache-secrets"),
        ("Secret", "uc-unicache-tls"),  # the router's certificate and Redis's (secret-tls.yaml)
        ("Service", "uc-unicache-redis"),
        ("Service", "uc-unicache-redis-headless"),
        ("Service", "uc-unicache-router"),
        ("Service", "uc-unicache-vllm-headless"),
        ("ServiceMonitor", "uc-unicache-router"),
        ("StatefulSet", "uc-unicache-redis"),
        ("StatefulSet", "uc-unicache-vllm"),
    ]


def test_vllm_statefulset_runs_vllm_serve_with_unicache_prefix_caching_and_kv_events(rendered):
    sts = one(rendered["vllm"], "StatefulSet", "vllm")
    spec = sts["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "uc-unicache-vllm-headless"
    assert c["command"] == ["vllm"]
    args = c["args"]
    assert args[:2] == ["serve", "/models/Qwen2.5-7B-Instruct"]  # the chart's model volume

    def flag(name):
        return args[args.index(name) + 1]

    assert (flag("--host"), flag("--port"), flag("--served-model-name")) == ("0.0.0.0", "8000", "Qwen2.5-7B-Instruct")
    assert flag("--block-size") == "32"  # settings.blockSize, the router's block_size too
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    assert flag("--scheduler-cls") == "unicache.replica.engines.vllm.scheduler.UniCacheScheduler"
    assert json.loads(flag("--additional-config")) == {"unicache": {"eviction_policy": "lru"}}
    assert json.loads(flag("--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    assert (flag("--tensor-parallel-size"), flag("--gpu-memory-utilization"), flag("--max-model-len")) == ("2", "0.85", "32768")
    assert args[-2:] == ["--kv-cache-dtype", "fp8"] and "--enforce-eager" not in args
    from unicache.replica.engines.vllm.config import SCHEDULER_CLS

    assert flag("--scheduler-cls") == SCHEDULER_CLS
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("kv-events", 5557), ("kv-replay", 5558)]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2 and c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1800
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    assert spec["tolerations"] == VLLM["backends"]["vllm"]["tolerations"]
    assert c["image"] == one(rendered["ray"], "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]


def test_vllms_own_serve_parser_takes_the_statefulsets_arguments(rendered):
    """vLLM 0.32's `vllm serve` parser (the CPU wheel the tests install has the same CLI)
    reads every argument the chart writes as the chart means it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = one(rendered["vllm"], "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args[1:])
    assert (ns.model_tag, ns.host, ns.port, ns.served_model_name) == ("/models/Qwen2.5-7B-Instruct", "0.0.0.0", 8000, ["Qwen2.5-7B-Instruct"])
    assert (ns.block_size, ns.enable_prefix_caching, ns.enable_prompt_tokens_details) == (32, True, True)
    assert ns.scheduler_cls == "unicache.replica.engines.vllm.scheduler.UniCacheScheduler"
    assert ns.additional_config == {"unicache": {"eviction_policy": "lru"}}
    events = ns.kv_events_config
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint, events.replay_endpoint) == (True, "zmq", "tcp://*:5557", "tcp://*:5558")
    assert (ns.tensor_parallel_size, ns.gpu_memory_utilization, ns.max_model_len, ns.kv_cache_dtype) == (2, 0.85, 32768, "fp8")


def test_vllm_default_args_are_the_documented_command():
    """Defaults: eviction policy unicache, block size 16, no optional vLLM flags."""
    args = one(documents(render(VLLM_ONE_ROUTER)), "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == [
        "serve", "/models/Qwen2.5-7B-Instruct", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "Qwen2.5-7B-Instruct", "--block-size", "16", "--enable-prefix-caching",
        "--scheduler-cls", "unicache.replica.engines.vllm.scheduler.UniCacheScheduler",
        "--additional-config", '{"unicache":{"eviction_policy":"unicache"}}',
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558"}',
        "--enable-prompt-tokens-details", "--tensor-parallel-size", "1",
    ]


def test_the_router_lists_every_vllm_pod_by_its_stable_dns_name(rendered):
    docs = rendered["vllm"]
    sts = one(docs, "StatefulSet", "vllm")
    svc = one(docs, "Service", "vllm")
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("http", 8000), ("kv-events", 5557), ("kv-replay", 5558)]
    cfg = router_config(docs)
    hosts = [f"uc-unicache-vllm-{i}.uc-unicache-vllm-headless.{NAMESPACE}.svc.cluster.local" for i in range(3)]
    assert [(b.backend_id, b.url, b.events, b.replay) for b in cfg.backend_specs()] == [
        (f"uc-unicache-vllm-{i}", f"http://{h}:8000", f"tcp://{h}:5557", f"tcp://{h}:5558") for i, h in enumerate(hosts)]
    # several router pods (the HPA): Redis only to share sessions; the tokenizer is the model's
    assert (cfg.use_redis, cfg.block_size, cfg.checkpoint, cfg.served_model_name) == (True, 32, "/models/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct")
    router_pod = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in router_pod["containers"][0]["volumeMounts"]


def test_only_router_pods_reach_the_vllm_ports(rendered):
    docs = rendered["vllm"]
    policy = one(docs, "NetworkPolicy", "vllm")["spec"]
    sts_labels = one(docs, "StatefulSet", "vllm")["spec"]["template"]["metadata"]["labels"]
    router_labels = one(docs, "Deployment", "router")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= sts_labels.items() and policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    [source] = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert sorted(p["port"] for p in rule["ports"]) == [5557, 5558, 8000]
    # no other policy opens the vLLM pods (the Ray policy, which admits every release pod, is gone)
    for p in find(docs, "NetworkPolicy"):
        selected = p["spec"]["podSelector"].get("matchLabels", {})
        if selected.items() <= sts_labels.items():
            assert p["metadata"]["name"] == "uc-unicache-vllm"


@pytest.mark.parametrize("mode_set", sorted(MODE_SETS))
def test_every_pod_outside_ray_mode_has_a_network_policy(rendered, mode_set):
    """The Ray policy is gone, so the `helm test` pod (it serves nothing) has its own
    deny-all policy; the other pods keep theirs (checkov's CKV2_K8S_6 checks the same)."""
    docs = rendered[mode_set]
    policies = [p["spec"]["podSelector"]["matchLabels"] for p in find(docs, "NetworkPolicy")]
    for _, doc in docs:
        for label, spec in pod_specs(doc):
            labels = doc["metadata"]["labels"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]["labels"]
            assert any(sel.items() <= labels.items() for sel in policies), (mode_set, label)
    assert one(docs, "NetworkPolicy", "test")["spec"]["ingress"] == []


def test_one_router_process_needs_no_redis(rendered):
    docs = rendered["vllm-one-router"]
    assert not [d for _, d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
    env = container_env(router_container(docs))
    assert "UNICACHE_REDIS_URL" not in env and "UNICACHE_REDIS_PASSWORD" not in env
    cfg = router_config(docs)
    assert (cfg.use_redis, len(cfg.backend_specs())) == (False, 2)


def test_vllm_mode_needs_a_model():
    with pytest.raises(Exception, match="backends.mode=vllm needs a model"):
        render({"backends": {"mode": "vllm"}})


# --- external ---------------------------------------------------------------------------------


def test_external_urls_reach_the_router_without_rbac(rendered):
    docs = rendered["external"]
    cfg = router_config(docs)
    assert [(b.backend_id, b.url, b.events, b.replay) for b in cfg.backend_specs()] == [
        ("a", "http://vllm-a.fleet.svc:8000", "tcp://vllm-a.fleet.svc:5557", "tcp://vllm-a.fleet.svc:5558"),
        ("vllm-vllm-b.fleet.svc-8000", "http://vllm-b.fleet.svc:8000", "tcp://vllm-b.fleet.svc:5557", ""),
    ]
    assert cfg.tokenizer == "/models/tok/tokenizer.json" and cfg.backend_discovery == ""
    assert not find(docs, "Role") and not find(docs, "RoleBinding") and not find(docs, "ServiceAccount")
    assert not find(docs, "StatefulSet", "vllm") and not find(docs, "NetworkPolicy", "vllm")
    pod = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    assert "kube-api-access" not in {v["name"] for v in pod["volumes"]}


def test_external_dns_discovery_is_the_routers_backend_discovery():
    from unicache.router.upstream.vllm_fleet.fleet import DnsDiscovery

    docs = documents(render({"backends": {"mode": "external", "external": {"dnsDiscovery": "dns://vllm.fleet.svc:8000?kv-events=5557&replay=5558"}}}))
    cfg = router_config(docs)
    assert (cfg.backends, cfg.backend_discovery) == ("", "dns://vllm.fleet.svc:8000?kv-events=5557&replay=5558")
    found = DnsDiscovery(cfg.backend_discovery)
    assert (found.name, found.http_port, found.events_port, found.replay_port) == ("vllm.fleet.svc", 8000, 5557, 5558)
    assert not find(docs, "Role")


def test_external_selector_renders_read_only_rbac_and_the_selector(rendered):
    docs = rendered["external-selector"]
    sa = one(docs, "ServiceAccount")
    role = one(docs, "Role")
    binding = one(docs, "RoleBinding")
    assert sa["metadata"]["namespace"] == NAMESPACE and sa["automountServiceAccountToken"] is False
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "fleet"  # the fleet's namespace
    assert [(r["apiGroups"], r["resources"], r["verbs"]) for r in role["rules"]] == [
        (["discovery.k8s.io"], ["endpointslices"], ["get", "list", "watch"]),  # what the discovery reads, nothing else
    ]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    pod = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    # the token is projected for the router container only, short-lived, at the standard path
    [volume] = [v for v in pod["volumes"] if v["name"] == "kube-api-access"]
    assert volume["projected"]["sources"][0]["serviceAccountToken"] == {"path": "token", "expirationSeconds": 3600}
    assert {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    # The router follows the selected slices' ready endpoints (router/upstream/vllm_fleet/k8s_discovery.py).
    from unicache.router.upstream.vllm_fleet.fleet import parse_discovery

    cfg = router_config(docs)
    assert (cfg.backends, cfg.backend_discovery) == ("", "k8s://fleet?selector=app=vllm,tier=gpu&port=8000&kv-events=5557&replay=5558")
    d = parse_discovery(cfg.backend_discovery)
    assert (d.namespace, d.selector, d.port, d.events_port, d.replay_port) == ("fleet", "app=vllm,tier=gpu", 8000, 5557, 5558)
    named = router_config(documents(render({"backends": {"mode": "external", "external": {
        "selector": {"app": "vllm"}, "selectorPorts": {"http": "http", "kvEvents": "kv-events", "replay": ""}}}})))
    assert named.backend_discovery == f"k8s://{NAMESPACE}?selector=app=vllm&port=http&kv-events=kv-events"


# --- checkov and docs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_report(tmp_path_factory) -> list[dict]:
    return run_checkov(MODE_SETS, tmp_path_factory.mktemp("rendered-modes"))


def test_checkov_is_clean_in_every_mode(checkov_report):
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in checkov_report for c in r["results"]["failed_checks"]]
    assert failed == []
    assert sum(r["summary"]["parsing_errors"] for r in checkov_report) == 0
    skipped = [c for r in checkov_report for c in r["results"]["skipped_checks"]]
    assert {c["check_id"] for c in skipped} <= {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_43"}
    assert all(len(c["check_result"].get("suppress_comment", "")) > 20 for c in skipped)
    checked = {Path(c["file_path"]).name.split("__", 1)[0] for r in checkov_report for c in r["results"]["passed_checks"]}
    assert checked == set(MODE_SETS)


def docs_section() -> str:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    start = text.index("## Routing your own vLLM fleet")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_docs_give_the_values_of_each_mode_and_the_events_threat():
    section = docs_section()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    modes = [b["backends"]["mode"] for b in blocks if isinstance(b, dict) and "backends" in b]
    assert modes == ["ray", "vllm", "external"]
    with helm.Chart.load(CHART) as chart:
        for block in blocks:
            chart.validate_schema(block)
    for phrase in ("NetworkPolicy", "forge", "misroute", "UNICACHE_BACKENDS", "EndpointSlices", "k8s://"):
        assert phrase.lower() in section.lower(), phrase
