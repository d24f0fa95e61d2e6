"""API keys -> tenants, and each tenant's cache salt.

Invariants:
    * A key is compared against every known key with ``hmac.compare_digest`` (no early
      exit on the first match), so response time does not reveal key prefixes.
    * ``cache_salt(t) = HMAC-SHA256(salt_secret, t)[:16]``: two tenants get different
      salts (with overwhelming probability), so the first block hash, and with it every
      chained hash, differs, and no cached block is ever shared across tenants. Without
      the secret nobody can compute a tenant's salt.
    * Keys and the secret never appear in exceptions, logs or metrics.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from unicache.contract.request_class import DEFAULT_TENANT
from unicache.plumbing.errors import UsageError

SALT_BYTES = 16


class AuthError(Exception):
    """Missing or unknown API key (gRPC UNAUTHENTICATED, HTTP 401). Message is key-free."""


def parse_api_keys(spec: str) -> dict[str, str]:
    """Parse ``"key1:tenantA,key2:tenantB"`` (also newline-separated) into {key: tenant}."""
    out: dict[str, str] = {}
    for n, item in enumerate(p.strip() for p in spec.replace("\n", ",").split(",")):
        if not item or item.startswith("#"):
            continue
        key, sep, tenant = item.rpartition(":")
        if not sep or not key or not tenant.strip():
            raise UsageError(f"API key entry {n + 1}: expected 'key:tenant'")
        out[key.strip()] = tenant.strip()
    return out


def load_api_keys_file(path: str) -> dict[str, str]:
    """Read ``key:tenant`` lines, or a JSON object {key: tenant}."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read API keys file {path}: {exc.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"API keys file {path}: bad JSON at line {exc.lineno}") from None
        return {str(k): str(v) for k, v in data.items()}
    return parse_api_keys(text)


class Authenticator:
    """Maps API keys to tenants and tenants to cache salts.

    Args:
        keys: {api_key: tenant}.
        salt_secret: server secret the salts derive from. Required when ``enabled``.
        enabled: False in local mode: every request is tenant ``"default"``.
    """

    def __init__(self, keys: dict[str, str], salt_secret: str, enabled: bool = True):
        if enabled and not keys:
            raise UsageError(
                "auth is enabled but no API keys are configured (set UNICACHE_API_KEYS or --api-keys-file, "
                "or pass --auth-enabled false to serve every request as tenant 'default')"
            )
        if enabled and not salt_secret:
            raise UsageError("auth is enabled but no salt secret is configured (set UNICACHE_SALT_SECRET or --salt-secret)")
        self.enabled = enabled
        self._keys = [(k.encode(), t) for k, t in keys.items()]
        self._secret = salt_secret.encode()
        self._salts: dict[str, bytes] = {}

    def authenticate(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; raises AuthError when missing or unknown."""
        if not self.enabled:
            return DEFAULT_TENANT
        if not api_key:
            raise AuthError("missing API key")
        given = api_key.encode()
        tenant = None
        for key, t in self._keys:
            if hmac.compare_digest(key, given) and tenant is None:
                tenant = t
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def cache_salt(self, tenant: str) -> bytes:
        salt = self._salts.get(tenant)
        if salt is None:
            salt = hmac.new(self._secret, tenant.encode(), hashlib.sha256).digest()[:SALT_BYTES]
            self._salts[tenant] = salt
        return salt


def api_key_from_headers(get) -> str | None:
    """Extract the key from ``authorization: Bearer KEY`` or ``x-api-key`` via ``get(name)``."""
    auth = get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = get("x-api-key")
    return key.strip() if key else None
