"""The chart's transport security by default: with no Secret and no cert-manager issuer
given it issues the cluster CA and every certificate itself (secret-tls.yaml), router and
replicas run mutual TLS with them, and its Redis serves TLS only (``rediss://``) under the
same CA; ``insecureNoTls`` renders all of it away and tells the processes so.

The certificates are checked by use: a real TLS handshake between the contexts
unicache/plumbing/tls.py builds from them, and a real redis-server serving them.
NOTE: helm-python-sdk renders offline, so ``lookup`` finds no live Secret: these tests see
the fresh-install path (everything issued); the upgrade path keeps what the live Secret
holds and issues only what is missing from its CA.
"""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import threading
import time

import kubernetes_validate
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from unicache.plumbing.redis_server import free_port
from unicache.plumbing.tls import ANY_REPLICA_NAME, ROUTER_NAME, ClientTls, TlsFiles, hop_server_context, replica_dns_name
from tests.deploy.test_helm_chart import KUBE_VERSION, NAMESPACE, RELEASE, documents, find, one, render

REPLICA_IDS = [f"{RELEASE}-replica-{i}" for i in range(2)]  # the default replica count
REDIS_SERVICE = f"{RELEASE}-unicache-redis"


def env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def pod(docs, kind: str, component: str) -> dict:
    return one(docs, kind, component)["spec"]["template"]["spec"]


def worker_pod(docs) -> dict:
    return one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def tls_secret(docs) -> dict[str, bytes]:
    secret = one(docs, "Secret", "tls")
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def dns_names(c: x509.Certificate) -> list[str]:
    return c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def signed_by(c: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        c.verify_directly_issued_by(ca)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not issued by ca"
        return False


@pytest.fixture(scope="module")
def default_docs():
    return documents(render({}))


@pytest.fixture(scope="module")
def files(default_docs, tmp_path_factory):
    """The generated Secret's entries written as files (0600), as the pods mount them."""
    d = tmp_path_factory.mktemp("chart-tls")
    out = {}
    for name, data in tls_secret(default_docs).items():
        path = d / name
        path.write_bytes(data)
        path.chmod(0o600)
        out[name] = str(path)
    return out


def test_default_render_runs_mutual_tls_on_certificates_the_chart_issued(default_docs):
    router = pod(default_docs, "Deployment", "router")
    router_env = env(router["containers"][0])
    assert {k: v for k, v in router_env.items() if k.startswith("UNICACHE_REPLICA_TLS")} == {
        "UNICACHE_REPLICA_TLS_CA": "/etc/unicache/tls/ca.pem",
        "UNICACHE_REPLICA_TLS_CERT": "/etc/unicache/tls/router.pem",
        "UNICACHE_REPLICA_TLS_KEY": "/etc/unicache/tls/router-key.pem",
    }
    launcher_env = env(pod(default_docs, "Deployment", "launcher")["containers"][0])
    assert launcher_env["UNICACHE_TLS_CERT"] == "/etc/unicache/tls/{replica_id}.pem"
    assert "UNICACHE_INSECURE_NO_TLS" not in router_env and "UNICACHE_INSECURE_NO_TLS" not in launcher_env
    assert find(default_docs, "Certificate") == []
    name = f"{RELEASE}-unicache-tls"

    def projected(spec) -> dict[str, tuple[str, str]]:
        vol = next(v for v in spec["volumes"] if v["name"] == "replica-tls")
        return {i["path"]: (s["secret"]["name"], i["key"]) for s in vol["projected"]["sources"] for i in s["secret"]["items"]}

    # The router trusts the cluster CA (servers); the replicas trust only the router CA (clients).
    assert projected(router) == {"ca.pem": (name, "ca.crt"), "router.pem": (name, "router.crt"), "router-key.pem": (name, "router.key")}
    worker = projected(worker_pod(default_docs))
    assert worker == {"ca.pem": (name, "router-ca.crt"),
                      **{f"{rid}{suffix}": (name, f"{rid}.{ext}") for rid in REPLICA_IDS for suffix, ext in ((".pem", "crt"), ("-key.pem", "key"))}}
    data = tls_secret(default_docs)
    assert sorted(data) == sorted(["ca.crt", "ca.key", "router-ca.crt", "router-ca.key", "router.crt", "router.key", "redis.crt", "redis.key"]
                                  + [f"{rid}.{ext}" for rid in REPLICA_IDS for ext in ("crt", "key")])
    ca, router_ca = cert(data["ca.crt"]), cert(data["router-ca.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    router_cert = cert(data["router.crt"])
    assert dns_names(router_cert) == [ROUTER_NAME] and signed_by(router_cert, router_ca) and not signed_by(router_cert, ca)
    for rid in REPLICA_IDS:
        c = cert(data[f"{rid}.crt"])
        assert dns_names(c) == [replica_dns_name(rid), ANY_REPLICA_NAME] and signed_by(c, ca) and not signed_by(c, router_ca)
        assert isinstance(c.public_key(), ec.EllipticCurvePublicKey) and c.public_key().curve.name == "secp256r1"
    redis_cert = cert(data["redis.crt"])
    assert dns_names(redis_cert) == [REDIS_SERVICE, f"{REDIS_SERVICE}.{NAMESPACE}.svc", f"{REDIS_SERVICE}.{NAMESPACE}.svc.cluster.local", "localhost"]
    assert signed_by(redis_cert, ca)


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str) -> str:
    """'ok' or the side that failed and why, over a loopback socket pair."""
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
                result["server"] = "ok"
        except (ssl.SSLError, OSError) as exc:
            result["server"] = f"server: {exc.__class__.__name__}"

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_hostname) as c:
            c.sendall(b"x")
            t.join(10)
    except (ssl.SSLError, OSError) as exc:
        t.join(10)
        return f"client: {exc.__class__.__name__}"
    return result.get("server", "no answer")


def test_the_generated_certificates_pass_and_refuse_exactly_as_the_code_expects(files):
    rid = REPLICA_IDS[0]
    replica = TlsFiles(files["router-ca.crt"], files[f"{rid}.crt"], files[f"{rid}.key"])  # as the worker pods mount them
    router = ClientTls(TlsFiles(files["ca.crt"], files["router.crt"], files["router.key"]))  # as the router pod does
    assert _handshake(hop_server_context(replica), router.hop_context(), replica_dns_name(rid)) == "ok"
    # The router refuses a replica certificate naming another id, the replicas refuse
    # another replica's certificate presented as a client, and the router's certificate
    # cannot serve as a replica.
    assert _handshake(hop_server_context(replica), router.hop_context(), replica_dns_name(REPLICA_IDS[1])).startswith("client:")
    other = REPLICA_IDS[1]
    as_client = ClientTls(TlsFiles(files["ca.crt"], files[f"{other}.crt"], files[f"{other}.key"]))
    assert _handshake(hop_server_context(replica), as_client.hop_context(), replica_dns_name(rid)) != "ok"
    router_as_server = TlsFiles(files["router-ca.crt"], files["router.crt"], files["router.key"])
    assert _handshake(hop_server_context(router_as_server), router.hop_context(), replica_dns_name(rid)).startswith("client:")


def test_redis_serves_tls_only_under_the_chart_ca(default_docs, files):
    sts = pod(default_docs, "StatefulSet", "redis")["containers"][0]
    args = sts["args"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-port") + 1] == "6379"
    assert args[args.index("--tls-auth-clients") + 1] == "no"  # clients authenticate with the password
    assert "--tls --cacert /etc/redis/tls/ca.crt" in sts["readinessProbe"]["exec"]["command"][-1]
    url = f"rediss://:$(UNICACHE_REDIS_PASSWORD)@{REDIS_SERVICE}.{NAMESPACE}.svc:6379/0"
    for spec in (pod(default_docs, "Deployment", "router"), pod(default_docs, "Deployment", "launcher")):
        e = env(spec["containers"][0])
        assert (e["UNICACHE_REDIS_URL"], e["UNICACHE_REDIS_TLS_CA"]) == (url, "/etc/unicache/redis-tls/ca.pem")
    for spec in (pod(default_docs, "Deployment", "router"), pod(default_docs, "Deployment", "launcher"), worker_pod(default_docs)):
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "redis-tls")
        assert mount == {"name": "redis-tls", "mountPath": "/etc/unicache/redis-tls", "readOnly": True}
        vol = next(v for v in spec["volumes"] if v["name"] == "redis-tls")
        assert vol["secret"]["secretName"] == f"{RELEASE}-unicache-tls" and vol["secret"]["items"] == [{"key": "ca.crt", "path": "ca.pem"}]
    # A real redis-server on the chart's certificate, as the StatefulSet runs it.
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", files["redis.crt"],
         "--tls-key-file", files["redis.key"], "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no",
         "--requirepass", "pw", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        good = redis.Redis.from_url(f"rediss://:pw@127.0.0.1:{port}/0", ssl_ca_certs=files["ca.crt"], socket_timeout=5)
        for _ in range(100):
            try:
                assert good.ping() is True
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server with the chart's certificate did not answer")
        with pytest.raises(redis.ConnectionError):  # a client trusting another CA refuses the server
            redis.Redis.from_url(f"rediss://:pw@127.0.0.1:{port}/0", ssl_ca_certs=files["router-ca.crt"], socket_timeout=5).ping()
        with pytest.raises(redis.ConnectionError):  # and plain text gets nothing
            redis.Redis.from_url(f"redis://:pw@127.0.0.1:{port}/0", socket_timeout=2).ping()
        good.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_opt_out_renders_without_tls_and_says_so():
    docs = documents(render({"insecureNoTls": True}))
    assert find(docs, "Secret", "tls") == [] and find(docs, "Certificate") == []
    for spec in (pod(docs, "Deployment", "router"), pod(docs, "Deployment", "launcher"), worker_pod(docs)):
        assert not {"replica-tls", "redis-tls"} & {v["name"] for v in spec["volumes"]}
        e = env(spec["containers"][0])
        assert not any(k.startswith(("UNICACHE_REPLICA_TLS", "UNICACHE_TLS_", "UNICACHE_REDIS_TLS")) for k in e)
    for component in ("router", "launcher"):
        e = env(pod(docs, "Deployment", component)["containers"][0])
        assert e["UNICACHE_INSECURE_NO_TLS"] == "true"
        assert e["UNICACHE_REDIS_URL"].startswith("redis://")
    args = pod(docs, "StatefulSet", "redis")["containers"][0]["args"]
    assert args[args.index("--port") + 1] == "6379" and "--tls-port" not in args
    for _, doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Service", "Secret", "ConfigMap"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_tls_off_without_the_named_opt_out_is_refused():
    with pytest.raises(Exception, match="replicaTls.enabled is false: .* set insecureNoTls: true"):
        render({"replicaTls": {"enabled": False}})


def test_given_sources_still_win_and_redis_keeps_its_own_tls():
    docs = documents(render({"replicaTls": {"source": "secret", "existingSecret": "uc-mtls"}}))
    data = tls_secret(docs)
    assert sorted(data) == ["ca.crt", "ca.key", "redis.crt", "redis.key"]
    router = pod(docs, "Deployment", "router")
    vol = next(v for v in router["volumes"] if v["name"] == "replica-tls")
    assert {s["secret"]["name"] for s in vol["projected"]["sources"]} == {"uc-mtls"}
    # An external Redis brings its own TLS: nothing is issued for it.
    ext = documents(render({"redis": {"enabled": False, "external": {"url": "redis://r.example:6379/0"}}}))
    assert "redis.crt" not in tls_secret(ext)
    assert "UNICACHE_REDIS_TLS_CA" not in env(pod(ext, "Deployment", "router")["containers"][0])
