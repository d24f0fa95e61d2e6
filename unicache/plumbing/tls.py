"""Mutual TLS between the router and its replicas: the cluster CA, certificates that name
a replica id, and TLS settings for both transports that pick up rotated files.

Names (one definition, imported by both sides):
    * a replica's certificate has the DNS names ``<label>.replica.unicache`` (its id,
      ``replica_dns_name``) and ``replica.unicache`` (any replica of the cluster), the URI
      ``unicache://replica/<id>``, and extended key usage serverAuth only;
    * the router's certificate has ``router.unicache`` and clientAuth only, so a replica's
      certificate cannot pass as the router's, nor the router's as a replica's.

The router calls ``Generate`` (either transport) only on a connection whose server proved
the id the router expects from the signed heartbeat (hostname check against
``replica_dns_name(id)``) before any request byte is sent; the summary a new replica is
admitted on is fetched from "any replica of the cluster" (``ANY_REPLICA_NAME``) and proves
its id by its sealed, nonce-bound content. Replicas require the router's client
certificate; nothing carries a bearer credential.

Rotation: ``TlsFiles`` re-reads its three files when one's mtime or size changes (checked
at most every ``check_interval_s``); servers take the new material for the next handshake
(gRPC: dynamic server credentials; hop: the SNI callback swaps the context), the router
for its next connection.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REPLICA_NAME_SUFFIX = ".replica.unicache"
ANY_REPLICA_NAME = "replica.unicache"
ROUTER_NAME = "router.unicache"
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def replica_dns_name(replica_id: str) -> str:
    """The DNS name a replica's certificate carries for ``replica_id``: the id itself when
    it is a DNS label (lowercase letters, digits, inner hyphens, at most 63), else ``h-``
    and 40 hex digits of its SHA-256 (ids with other characters stay distinct)."""
    label = replica_id if _LABEL.fullmatch(replica_id) else "h-" + hashlib.sha256(replica_id.encode()).hexdigest()[:40]
    return label + REPLICA_NAME_SUFFIX


@dataclass(slots=True)
class TlsMaterial:
    """PEM bytes of one side's TLS files, and their generation (bumped on every change)."""

    ca: bytes
    cert: bytes
    key: bytes
    generation: int


@dataclass(slots=True)
class TlsFiles:
    """One side's CA bundle, certificate chain and private key files, re-read when they
    change (see the module docstring). ``material()`` is safe from any thread (gRPC calls
    the server's fetcher from its own)."""

    ca: str
    cert: str
    key: str
    check_interval_s: float = 1.0
    _stamp: tuple = field(default=(), init=False, repr=False)
    _material: TlsMaterial | None = field(default=None, init=False, repr=False)
    _checked_at: float = field(default=float("-inf"), init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.material()  # unreadable files fail at start-up, not at the first connection

    def _stat(self) -> tuple:
        out = []
        for path in (self.ca, self.cert, self.key):
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def material(self) -> TlsMaterial:
        """The current files' contents (re-read if they changed since the last check)."""
        with self._lock:
            now = time.monotonic()
            if self._material is not None and now - self._checked_at < self.check_interval_s:
                return self._material
            self._checked_at = now
            try:
                stamp = self._stat()
            except OSError:
                if self._material is not None:  # mid-rotation (a file being replaced): keep the last
                    return self._material
                raise
            if stamp != self._stamp or self._material is None:
                ca, cert, key = (open(p, "rb").read() for p in (self.ca, self.cert, self.key))
                generation = self._material.generation + 1 if self._material is not None else 1
                self._material, self._stamp = TlsMaterial(ca, cert, key, generation), stamp
            return self._material


# --- mutual TLS by default: the named opt-out ------------------------------------------
INSECURE_NO_TLS = "insecure_no_tls"
"""The settings field (router and replica alike; ``--insecure-no-tls true``,
``UNICACHE_INSECURE_NO_TLS=1``) that lets a process holding a cluster key run without
mutual TLS between router and replicas."""

INSECURE_GIVES_UP = (
    "a process bound to a dead replica's ports is sent requests (prompts and tenant salts) and the router's "
    "bearer credential, which replays on every replica for 60 s, and a relay in front of a live replica reads "
    "every request in clear (docs/security.md)"
)


def insecure_transport(*, component: str, keyed: bool, has_tls: bool, insecure: bool, tls_settings: str) -> bool:
    """Whether ``component`` runs without mutual TLS by the explicit opt-out
    (``INSECURE_NO_TLS``), logging a warning each time it says so (at every start).

    A process holding the cluster key talks to the other side of the cluster; it must do
    so over mutual TLS (``tls_settings``, the settings that name its files) unless the
    opt-out is set. UsageError, naming the fix, when neither is given, and when both are
    (the opt-out would silently mean nothing).
    """
    from unicache.plumbing.errors import UsageError

    if has_tls and insecure:
        raise UsageError(f"{INSECURE_NO_TLS} is set but so are {tls_settings}: drop one (mutual TLS is the default)")
    if insecure:
        log.warning("INSECURE: %s runs without mutual TLS (%s is set): %s", component, INSECURE_NO_TLS, INSECURE_GIVES_UP)
        return True
    if keyed and not has_tls:
        raise UsageError(
            f"{component} has a cluster key but no mutual TLS: set {tls_settings} (files from the cluster CA; "
            f"`unicache up` and the Helm chart make them), or set {INSECURE_NO_TLS} "
            f"(--{INSECURE_NO_TLS.replace('_', '-')} true, UNICACHE_{INSECURE_NO_TLS.upper()}=1) to run without it "
            "(what that gives up: docs/security.md)"
        )
    return False


# --- the replica's side ---------------------------------------------------------------
def grpc_server_credentials(files: TlsFiles):
    """gRPC server credentials requiring a client certificate from the cluster CA, taking
    rotated files for the next handshake."""
    import grpc

    def config(m: TlsMaterial):
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    state = {"generation": files.material().generation}

    def fetch():
        m = files.material()
        if m.generation == state["generation"]:
            return None  # unchanged
        state["generation"] = m.generation
        return config(m)

    return grpc.dynamic_ssl_server_credentials(config(files.material()), fetch, require_client_authentication=True)


def _context(purpose: ssl.Purpose, m: TlsMaterial, files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=m.ca.decode())
    # NOTE: load_cert_chain takes paths only; the files may have moved on since ``m`` was
    # read, which is harmless (both are current files of the same rotation).
    ctx.load_cert_chain(files.cert, files.key)
    return ctx


def hop_server_context(files: TlsFiles) -> ssl.SSLContext:
    """The hop server's TLS context: client certificate required; rotated files are taken
    at the next handshake (the SNI callback swaps in a context built from them)."""
    m = files.material()
    ctx = _context(ssl.Purpose.CLIENT_AUTH, m, files)
    current = {"generation": m.generation, "ctx": ctx}

    def swap(sock: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:  # noqa: ARG001
        now = files.material()
        if now.generation != current["generation"]:
            fresh = _context(ssl.Purpose.CLIENT_AUTH, now, files)
            fresh.sni_callback = swap
            current.update(generation=now.generation, ctx=fresh)
        if current["ctx"] is not sock.context:
            sock.context = current["ctx"]

    ctx.sni_callback = swap
    return ctx


# --- the router's side -----------------------------------------------------------------
class ClientTls:
    """The router's TLS towards replicas: gRPC channel credentials and hop contexts, both
    rebuilt when the files rotate (``generation`` tells callers to make new channels)."""

    def __init__(self, files: TlsFiles):
        self.files = files
        self._generation = 0
        self._grpc = None
        self._hop: ssl.SSLContext | None = None

    def _refresh(self) -> None:
        m = self.files.material()
        if m.generation != self._generation:
            import grpc

            self._grpc = grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)
            self._hop = _context(ssl.Purpose.SERVER_AUTH, m, self.files)
            self._generation = m.generation

    @property
    def generation(self) -> int:
        self._refresh()
        return self._generation

    def grpc_credentials(self):
        self._refresh()
        return self._grpc

    def hop_context(self) -> ssl.SSLContext:
        self._refresh()
        return self._hop


def client_tls(ca: str, cert: str, key: str) -> ClientTls | None:
    """The router's ``ClientTls`` from its three files, or None when none is set.
    UsageError when one cannot be read (a start-up error, not a failed connection)."""
    if not cert:
        return None
    from unicache.plumbing.errors import UsageError

    try:
        return ClientTls(TlsFiles(ca, cert, key))
    except OSError as exc:
        raise UsageError(f"replica tls: cannot read {exc.filename}: {exc.strerror}") from None


def grpc_channel_options(replica_id: str) -> list[tuple[str, str]]:
    """Channel options making gRPC check that the server's certificate names
    ``replica_id`` ("" for any replica of the cluster)."""
    return [("grpc.ssl_target_name_override", replica_dns_name(replica_id) if replica_id else ANY_REPLICA_NAME)]


# --- making certificates (``unicache up``, tests) ---------------------------------------
@dataclass(slots=True, frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes


class ClusterCA:
    """An ephemeral cluster CA (ECDSA P-256) issuing replica and router certificates.

    Args:
        name: the CA's common name.
        valid_days: validity of the CA and of what it issues (default 30).
    """

    def __init__(self, name: str = "unicache cluster CA", valid_days: int = 30):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.valid_days = valid_days
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._name = subject
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.cert.public_bytes(serialization.Encoding.PEM)

    def _issue(self, common_name: str, dns: list[str], uris: list[str], server: bool, ips: list[str] = ()) -> Issued:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        names = [x509.DNSName(d) for d in dns] + [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.valid_days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem)

    def issue_replica(self, replica_id: str) -> Issued:
        """A replica's server certificate naming ``replica_id`` (see the module docstring)."""
        return self._issue(f"replica {replica_id}", [replica_dns_name(replica_id), ANY_REPLICA_NAME], [f"unicache://replica/{replica_id}"], server=True)

    def issue_router(self) -> Issued:
        """The router's client certificate."""
        return self._issue("router", [ROUTER_NAME], [], server=False)


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (0600), replacing it
    atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_tls_files(directory: str, prefix: str, ca_pem: bytes, issued: Issued) -> TlsFiles:
    """Write ``<prefix>-ca.pem``, ``<prefix>.pem`` and ``<prefix>-key.pem`` (0600) into
    ``directory``; returns them as ``TlsFiles``."""
    paths = [os.path.join(directory, f"{prefix}{suffix}") for suffix in ("-ca.pem", ".pem", "-key.pem")]
    for path, data in zip(paths, (ca_pem, issued.cert_pem, issued.key_pem)):
        write_private(path, data)
    return TlsFiles(*paths)


def make_cluster_pki(directory: str, replica_ids: list[str]) -> tuple[TlsFiles, tuple[str, str, str]]:
    """An ephemeral cluster CA and its certificates in ``directory`` (files 0600): the
    router's (``router*.pem``) and one per replica id (``<id>.pem``, ``<id>-key.pem``,
    ``<id>-ca.pem``). Returns the router's files and the replicas' (CA, certificate, key)
    paths with ``{replica_id}`` standing for the id, as ``ReplicaSettings`` takes them.
    The CA's key is never written: nothing more can be issued once this returns."""
    ca = ClusterCA()
    router = write_tls_files(directory, "router", ca.cert_pem, ca.issue_router())
    for rid in replica_ids:
        write_tls_files(directory, rid, ca.cert_pem, ca.issue_replica(rid))
    return router, (router.ca, os.path.join(directory, "{replica_id}.pem"), os.path.join(directory, "{replica_id}-key.pem"))
