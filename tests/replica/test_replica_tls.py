"""Mutual TLS between the router and its replicas (issue 39), over both transports.

A router (static replicas r0, r1, a cluster key, round robin) with a cluster CA made by
``unicache.plumbing.tls.ClusterCA``; fake replicas serve gRPC and the framed hop with TLS. Each case
asserts what crossed the wire: no bearer credential, no request to an impostor, no
readable request through a relay, and which replica served every client request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import httpx
import pytest

from unicache.contract.state_auth import CALL_METADATA, CallCredential
from unicache.plumbing.tls import ClientTls, ClusterCA, TlsFiles, replica_dns_name, write_tls_files
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.upstream.replica_client import PROBE_REQUEST_ID, ReplicaClients
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.polling import eventually
from unicache.testing.signed_state import CLUSTER_KEY, parse_cluster_key
from unicache.testing.tcp_relay import RecordingRelay
from unicache.v1 import common_pb2, replica_pb2

KEY = parse_cluster_key(CLUSTER_KEY)
REQUESTS = 8
PROMPT = "the tenant's secret prompt"


@pytest.fixture
def pki(tmp_path):
    """The cluster CA's files for r0, r1, the router; and an impostor's for 'r9'."""
    ca = ClusterCA()
    d = str(tmp_path)
    files = {name: write_tls_files(d, name, ca.cert_pem, ca.issue_replica(name)) for name in ("r0", "r1", "r9")}
    files["router"] = write_tls_files(d, "router", ca.cert_pem, ca.issue_router())
    files["ca"] = ca
    files["dir"] = d
    return files


async def start_router(r0: FakeReplica, r1: FakeReplica, pki, transport: str, r1_hop: str | None = None) -> RouterApp:
    hop1 = r1_hop or f"127.0.0.1:{r1.hop.port}"
    cfg = build_config(
        env={"UNICACHE_CLUSTER_KEY": CLUSTER_KEY},
        overrides={
            "grpc_port": 0, "http_port": 0, "use_redis": False, "auth_enabled": False, "routing_policy": "round_robin",
            "replicas": f"r0={r0.address}@127.0.0.1:{r0.hop.port},r1={r1.address}@{hop1}", "replica_transport": transport,
            "replica_tls_ca": pki["router"].ca, "replica_tls_cert": pki["router"].cert, "replica_tls_key": pki["router"].key,
        },
    )
    app = RouterApp(cfg)
    await app.start()
    return app


async def ask(app: RouterApp, n: int = REQUESTS) -> list[tuple[int, str | None]]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=30) as client:
        out = []
        for i in range(n):
            r = await client.post("/v1/completions", json={"prompt": f"{PROMPT} {i}", "max_tokens": 2})
            out.append((r.status_code, r.headers.get("x-unicache-replica")))
        return out


def generate_calls(rep: FakeReplica) -> list[set[str]]:
    return [keys for keys in rep.metadata_keys]


@pytest.mark.parametrize("transport", ["auto", "grpc"])
async def test_requests_cross_mutual_tls_without_a_bearer_credential(pki, transport):
    r0, r1 = FakeReplica("r0"), FakeReplica("r1")
    await r0.start(hop=True, cluster_key=KEY, tls=pki["r0"])
    await r1.start(hop=True, cluster_key=KEY, tls=pki["r1"])
    app = await start_router(r0, r1, pki, transport)
    try:
        assert await ask(app) == [(200, "r0"), (200, "r1")] * (REQUESTS // 2)
        assert app.clients.credential is None
        grpc_calls = r0.metadata_keys + r1.metadata_keys
        assert all(CALL_METADATA not in keys for keys in grpc_calls)
        assert len(grpc_calls) == (REQUESTS if transport == "grpc" else 0)  # "auto" sends them over the TLS hop
    finally:
        await app.stop()
        await r0.stop()
        await r1.stop()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
@pytest.mark.parametrize("impostor_cert", ["another_replicas_cert", "r1_cert_from_another_ca"])
async def test_an_impostor_on_a_killed_replicas_ports_receives_nothing(pki, transport, impostor_cert, tmp_path):
    """r1 dies; a process binds its gRPC and hop ports with a certificate that does not
    name r1 under the cluster CA. The router sends it no request (the TLS handshake fails
    before any byte of one), retries on r0, and no client sees a failure."""
    r0, r1 = FakeReplica("r0"), FakeReplica("r1")
    await r0.start(hop=True, cluster_key=KEY, tls=pki["r0"])
    await r1.start(hop=True, cluster_key=KEY, tls=pki["r1"])
    app = await start_router(r0, r1, pki, transport)
    impostor = FakeReplica("r1")
    try:
        assert await ask(app, 2) == [(200, "r0"), (200, "r1")]
        ports = (r1.port, r1.hop.port)
        await r1.stop()
        if impostor_cert == "another_replicas_cert":
            files = pki["r9"]  # a genuine certificate of the cluster, for another replica
        else:
            other = ClusterCA("impostor CA")
            files = write_tls_files(str(tmp_path), "fake-r1", other.cert_pem, other.issue_replica("r1"))
        await impostor.start(hop=True, cluster_key=KEY, tls=files, port=ports[0], hop_port=ports[1])
        answers = await ask(app)
        assert answers == [(200, "r0")] * REQUESTS
        assert impostor.requests == [] and impostor.metadata_keys == []
        assert app.cluster.replicas["r1"].quarantined
    finally:
        await app.stop()
        await r0.stop()
        await impostor.stop()


async def test_a_relay_to_the_genuine_replica_reads_no_request(pki):
    """A process between the router and the genuine r1's hop forwards every byte both ways
    (as the handshake relay of issue 39 did): the requests still reach r1, and the relay
    saw neither a prompt nor a salt in clear."""
    r0, r1 = FakeReplica("r0"), FakeReplica("r1")
    await r0.start(hop=True, cluster_key=KEY, tls=pki["r0"])
    await r1.start(hop=True, cluster_key=KEY, tls=pki["r1"])
    relay = await RecordingRelay(r1.hop.port).start()
    app = await start_router(r0, r1, pki, "auto", r1_hop=relay.address)
    try:
        assert await ask(app) == [(200, "r0"), (200, "r1")] * (REQUESTS // 2)
        assert len(r1.served) == REQUESTS // 2 and len(relay.seen) > 0
        assert PROMPT.encode() not in relay.seen
        salts = {r.cache_salt for r in r1.served if r.cache_salt}
        assert all(salt not in relay.seen for salt in salts)
    finally:
        await app.stop()
        await r0.stop()
        await r1.stop()
        await relay.close()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
async def test_a_client_certificate_from_another_ca_is_refused(pki, transport, tmp_path):
    r0 = FakeReplica("r0")
    await r0.start(hop=True, tls=pki["r0"])
    other = ClusterCA("another CA")
    # the caller trusts the cluster CA (it can check r0) but its own certificate is another CA's
    mine = write_tls_files(str(tmp_path), "intruder", other.cert_pem, other.issue_router())
    intruder = TlsFiles(pki["router"].ca, mine.cert, mine.key)
    clients = ReplicaClients(transport=transport, tls=ClientTls(intruder))
    request = replica_pb2.GenerateRequest(request_id="x", text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=1))
    try:
        stream = clients.generate(r0.address, request, 5, f"127.0.0.1:{r0.hop.port}", "r0")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.first()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert r0.requests == [] and r0.metadata_keys == []
    finally:
        await clients.close()
        await r0.stop()


async def test_a_replica_certificate_cannot_act_as_the_router(pki):
    """Replica certificates are for serving only (extended key usage serverAuth): one
    replica's key does not let it call another replica."""
    r0 = FakeReplica("r0")
    await r0.start(tls=pki["r0"])
    clients = ReplicaClients(transport="grpc", tls=ClientTls(pki["r1"]))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await clients.probe(r0.address, 5, replica_id="r0")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and r0.requests == []
    finally:
        await clients.close()
        await r0.stop()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
async def test_rotated_certificates_are_picked_up_without_a_restart(pki, transport):
    """Both sides' files are replaced by a new CA's (same paths): new connections use
    them, so the router keeps serving, and a caller still holding the old files is
    refused by the replica."""
    r0, r1 = FakeReplica("r0"), FakeReplica("r1")
    await r0.start(hop=True, cluster_key=KEY, tls=pki["r0"])
    await r1.start(hop=True, cluster_key=KEY, tls=pki["r1"])
    app = await start_router(r0, r1, pki, transport)
    old_dir = os.path.join(pki["dir"], "old")
    os.mkdir(old_dir)
    old = write_tls_files(old_dir, "router", pki["ca"].cert_pem, pki["ca"].issue_router())
    try:
        assert await ask(app, 2) == [(200, "r0"), (200, "r1")]
        new_ca = ClusterCA("rotated CA")
        for name in ("r0", "r1"):
            write_tls_files(pki["dir"], name, new_ca.cert_pem, new_ca.issue_replica(name))
        write_tls_files(pki["dir"], "router", new_ca.cert_pem, new_ca.issue_router())

        async def refuses_the_old_files() -> bool:
            stale = ReplicaClients(transport=transport, tls=ClientTls(old))
            try:
                await stale.probe(r0.address, 5, f"127.0.0.1:{r0.hop.port}", "r0")
                return False
            except grpc.aio.AioRpcError:
                return True
            finally:
                await stale.close()

        await eventually(refuses_the_old_files, "the replica on its rotated files", timeout_s=20)
        await eventually(lambda: app.clients.tls.generation == 2, "the router on its rotated files", timeout_s=20)
        for rid in ("r0", "r1"):  # its open hop connections were made before: new ones now
            app.clients.forget_replica(rid)
        # new connections (new gRPC channels, new hops) with the new files, both ways
        assert await ask(app, 4) == [(200, "r0"), (200, "r1")] * 2
        assert not any(rec.quarantined for rec in app.cluster.replicas.values())
    finally:
        await app.stop()
        await r0.stop()
        await r1.stop()


def test_replica_names_are_dns_labels_or_digests():
    assert replica_dns_name("r0") == "r0.replica.unicache"
    assert replica_dns_name("unicache-replica-12") == "unicache-replica-12.replica.unicache"
    weird = replica_dns_name("Pod_7.a")
    assert weird.startswith("h-") and len(weird.split(".")[0]) == 42 and weird != replica_dns_name("pod_7.a")


def test_half_a_tls_setting_fails_at_start_up(pki):
    from unicache.plumbing.errors import UsageError
    from unicache.replica.settings import ReplicaSettings

    with pytest.raises(UsageError, match="mutual TLS with replicas needs all of replica_tls_ca, replica_tls_cert and replica_tls_key"):
        build_config(env={}, overrides={"replica_tls_cert": pki["router"].cert})
    with pytest.raises(UsageError, match="mutual TLS needs all of tls_ca, tls_cert and tls_key"):
        ReplicaSettings(tls_cert=pki["r0"].cert).check(local_paths=False)
    with pytest.raises(UsageError, match="tls: cannot read /nonexistent/key.pem"):
        ReplicaSettings(tls_ca=pki["r0"].ca, tls_cert=pki["r0"].cert, tls_key="/nonexistent/key.pem").tls_files()


def test_unicache_up_makes_an_ephemeral_pki_in_its_private_run_dir_and_removes_it():
    """``unicache up`` (LocalCluster) issues the router's and each replica's certificate
    from a CA made for the run, in its private dir (0700, files 0600, no CA key), wires
    them into the router's and the replicas' settings, and removes them at stop."""
    import stat

    from unicache.cli.local_cluster import ClusterSettings, LocalCluster, replica_settings

    cluster = LocalCluster(ClusterSettings(num_replicas=2))
    run_dir = cluster._tmp
    try:
        names = sorted(os.listdir(run_dir))
        assert [n for n in names if n.endswith(".pem")] == [
            "replica-0-ca.pem", "replica-0-key.pem", "replica-0.pem", "replica-1-ca.pem", "replica-1-key.pem", "replica-1.pem",
            "router-ca.pem", "router-key.pem", "router.pem",
        ]
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert {stat.S_IMODE(os.stat(os.path.join(run_dir, n)).st_mode) for n in names if n.endswith(".pem")} == {0o600}
        rc = cluster.router_config()
        assert (rc.replica_tls_ca, rc.replica_tls_cert, rc.replica_tls_key) == (
            cluster.router_tls.ca, cluster.router_tls.cert, cluster.router_tls.key)
        base = replica_settings(cluster.cfg, "redis://x", tls=cluster.replica_tls)
        files = dataclasses.replace(base, replica_id="replica-1").tls_files()
        assert files.cert == os.path.join(run_dir, "replica-1.pem")
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(open(files.cert, "rb").read())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["replica-1.replica.unicache", "replica.unicache"]
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["unicache://replica/replica-1"]
    finally:
        cluster.stop_backends()
    assert not os.path.exists(run_dir)
