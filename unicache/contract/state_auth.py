"""Authentication of replica state and of router->replica calls, from one cluster key.

The cluster key is a secret every replica and router of one cluster share and Redis never
sees. Two independent keys derive from it (HMAC-SHA256 with a fixed label), so a value
that authenticates one thing can never stand in for another:

    * the *state* key MACs what replicas write to Redis (heartbeats, summaries, event
      batches) and the summaries a replica returns over gRPC;
    * the *call* key makes the credential every router->replica gRPC call carries.

Signed state (``StateSigner``) is an envelope ``MAGIC || mac || payload`` where ``payload``
is the serialized protobuf and ``mac = HMAC(state_key, MAGIC || kind || 0x00 || payload)``.
The MAC covers the exact bytes (protobuf serialization is not canonical, so the reader
verifies the bytes, then parses), and ``kind`` ("hb", "summary", "events", "rpc-summary")
binds a payload to where it may be used: a signed heartbeat stored as a summary fails.
Routers seal what they share through Redis with the same key ("session": a session's
placement, ``unicache.router.cluster.session_store``; "routed": a batch of routing decisions'
effects on the policy's terms, ``unicache.router.cluster.terms_exchange``); a replica could write one, but a replica
already chooses what it serves.
Everything a reader trusts (replica id, address, epoch, seq, timestamp) is inside the
payload, so it is covered; readers also check the replica id against the Redis key.

Call credentials (``CallCredential``) are ``"<unix ms>.<hex mac>"`` with
``mac = HMAC(call_key, "call" || unix ms)``: valid for ``max_skew_s`` around the
verifier's clock, so a leaked credential is useless a minute later.

Invariants:
    * ``open`` returns a payload only if its MAC verifies under this key and kind;
      comparison is constant-time (``hmac.compare_digest``).
    * No function here logs or puts the key (or a MAC input) in an exception message.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

MAGIC = b"ucs1"
MAC_BYTES = 32
MIN_KEY_BYTES = 16
# gRPC metadata key of the cluster credential on every router->replica call.
CALL_METADATA = "x-unicache-cluster-auth"

KINDS = frozenset({"hb", "summary", "events", "rpc-summary", "session", "routed"})


class StateAuthError(ValueError):
    """A payload or credential failed authentication; ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_cluster_key(value: str | bytes) -> bytes:
    """The key as bytes: hex text (what ``new_cluster_key`` makes) decodes, any other
    text is used as UTF-8. Shorter than 16 bytes is refused (ValueError)."""
    if isinstance(value, bytes):
        raw = value
    else:
        text = value.strip()
        try:
            raw = bytes.fromhex(text) if len(text) % 2 == 0 and text else text.encode()
        except ValueError:
            raw = text.encode()
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"cluster key too short: need at least {MIN_KEY_BYTES} bytes")
    return raw


def new_cluster_key() -> str:
    """A fresh random cluster key as 64 hex characters (32 bytes)."""
    import secrets

    return secrets.token_hex(32)


def derive(key: bytes, label: str) -> bytes:
    return hmac.new(key, b"unicache/" + label.encode(), hashlib.sha256).digest()


class StateSigner:
    """Signs and opens replica-state envelopes with the state key of one cluster key."""

    __slots__ = ("_key",)

    def __init__(self, cluster_key: bytes):
        self._key = derive(cluster_key, "state/v1")

    def __repr__(self) -> str:  # never show the key
        return "StateSigner(***)"

    def _mac(self, kind: str, payload: bytes) -> bytes:
        if kind not in KINDS:
            raise ValueError(f"unknown state kind {kind!r}")
        return hmac.new(self._key, MAGIC + kind.encode() + b"\x00" + payload, hashlib.sha256).digest()

    def seal(self, kind: str, payload: bytes) -> bytes:
        """``MAGIC || mac || payload``."""
        return MAGIC + self._mac(kind, payload) + payload

    def open(self, kind: str, data: bytes | None) -> bytes:
        """The payload of a valid envelope; raises ``StateAuthError("bad_mac")`` otherwise
        (unsigned, truncated, another kind, another key, or modified)."""
        if not data or len(data) < len(MAGIC) + MAC_BYTES or not data.startswith(MAGIC):
            raise StateAuthError("bad_mac", f"unsigned or truncated {kind} payload")
        mac = data[len(MAGIC) : len(MAGIC) + MAC_BYTES]
        payload = data[len(MAGIC) + MAC_BYTES :]
        if not hmac.compare_digest(mac, self._mac(kind, payload)):
            raise StateAuthError("bad_mac", f"{kind} payload fails its MAC")
        return payload


class CallCredential:
    """Makes and checks the cluster credential of router->replica gRPC calls.

    Args:
        cluster_key: the cluster key (bytes).
        max_skew_s: how far a credential's time may be from the verifier's clock (60 s).
        refresh_s: the maker reuses one credential this long (10 s; well inside the skew).
        clock: wall clock (unix seconds).
    """

    __slots__ = ("_key", "max_skew_ms", "refresh_ms", "clock", "_cached")

    def __init__(
        self, cluster_key: bytes, max_skew_s: float = 60.0, refresh_s: float = 10.0, clock: Callable[[], float] = time.time
    ):
        self._key = derive(cluster_key, "call/v1")
        self.max_skew_ms = int(max_skew_s * 1000)
        self.refresh_ms = int(refresh_s * 1000)
        self.clock = clock
        self._cached: tuple[int, str] = (-(1 << 62), "")

    def __repr__(self) -> str:
        return "CallCredential(***)"

    def _mac(self, ms: int) -> str:
        return hmac.new(self._key, b"call" + str(ms).encode(), hashlib.sha256).hexdigest()

    def token(self) -> str:
        now = int(self.clock() * 1000)
        made, tok = self._cached
        if now - made >= self.refresh_ms or now < made:
            tok = f"{now}.{self._mac(now)}"
            self._cached = (now, tok)
        return tok

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CALL_METADATA, self.token()),)

    def check(self, token: str | None) -> None:
        """Raises ``StateAuthError`` ("missing", "bad_mac" or "stale") unless valid now."""
        if not token:
            raise StateAuthError("missing", "missing cluster credential")
        ms_text, dot, mac = token.partition(".")
        if not dot or not ms_text.isdigit() or len(ms_text) > 16:
            raise StateAuthError("bad_mac", "malformed cluster credential")
        ms = int(ms_text)
        if not hmac.compare_digest(mac.encode(), self._mac(ms).encode()):
            raise StateAuthError("bad_mac", "invalid cluster credential")
        if abs(int(self.clock() * 1000) - ms) > self.max_skew_ms:
            raise StateAuthError("stale", "expired cluster credential")
