"""Per-tenant admission limits: concurrent requests, prompt tokens per request, and
(optionally) prompt tokens per minute.

Each tenant gets ``TenantLimits``: the configured default with that tenant's overrides
applied field by field. ``0`` means "no limit" for every field. ``max_prompt_tokens`` may
also be ``FOLLOW_FLEET`` (-1, the default): the longest context a backend reports
(``max_model_len``: vLLM servers' ``/v1/models``, our replicas' heartbeats), or
``FLEET_UNKNOWN_PROMPT_TOKENS`` while none reports one; an explicit number still wins.

Overrides come from one string (``--tenant-limits`` / ``UNICACHE_TENANT_LIMITS`` / the
config file's ``tenant_limits``), either JSON::

    {"acme": {"max_concurrent": 4, "max_prompt_tokens": 2048}, "beta": {"tokens_per_minute": 100000}}

or the flat form ``acme.max_concurrent=4,acme.max_prompt_tokens=2048,beta.tokens_per_minute=100000``.

Invariants:
    * ``in_flight(t)`` equals the number of ``Lease`` objects of tenant ``t`` that were
      granted and not yet released; ``Lease.release`` is idempotent, so a caller that
      releases in a ``finally`` (finish, error, cancel) can never release twice.
    * A refused request changes no counter and no token window.
    * The token window holds only grants of the last ``window_s`` seconds; its sum is kept
      incrementally (amortised O(1) per grant).
    * Error messages name the tenant and the limit, never an API key.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from unicache.plumbing.errors import UsageError

WINDOW_S = 60.0
FOLLOW_FLEET = -1  # max_prompt_tokens: the backends' reported context
FLEET_UNKNOWN_PROMPT_TOKENS = 32768  # FOLLOW_FLEET while no backend reports its context
FLEET_REFRESH_S = 1.0  # how long one reading of the backends' context is used


class LimitExceeded(Exception):
    """A request over a tenant limit. ``kind`` is ``"overloaded"`` (retry later: gRPC
    RESOURCE_EXHAUSTED / HTTP 429) or ``"invalid"`` (never admissible: INVALID_ARGUMENT /
    HTTP 400); ``limit`` is the limit's name (a metrics label)."""

    def __init__(self, kind: str, limit: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.limit = limit


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """One tenant's limits; 0 disables a limit."""

    max_concurrent: int = 0
    max_prompt_tokens: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = FOLLOW_FLEET if f.name == "max_prompt_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                follow = " (or -1: the backends' context)" if least else ""
                raise UsageError(f"tenant limit {f.name} must be a non-negative integer{follow}, got {value!r}")


LIMIT_FIELDS = tuple(f.name for f in fields(TenantLimits))


def parse_tenant_limits(spec: str) -> dict[str, dict[str, int]]:
    """Parse the override string (JSON or ``tenant.field=value,...``) into
    {tenant: {field: value}}; a bad entry is a one-line UsageError."""
    spec = spec.strip()
    if not spec:
        return {}
    if spec.startswith("{"):
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise UsageError(f"tenant_limits: bad JSON at line {exc.lineno} column {exc.colno}") from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise UsageError("tenant_limits: expected {tenant: {limit: value}}")
        out = {str(t): dict(v) for t, v in data.items()}
    else:
        out = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            name, eq, value = item.partition("=")
            tenant, dot, limit = name.strip().rpartition(".")
            if not eq or not dot or not tenant:
                raise UsageError(f"tenant_limits entry {item!r}: expected tenant.limit=value")
            try:
                number = int(value.strip())
            except ValueError:
                raise UsageError(f"tenant_limits entry {item!r}: value must be an integer") from None
            out.setdefault(tenant, {})[limit] = number
    for tenant, limits in out.items():
        for name in limits:
            if name not in LIMIT_FIELDS:
                raise UsageError(f"tenant_limits for {tenant!r}: unknown limit {name!r} (known: {', '.join(LIMIT_FIELDS)})")
    return out


@dataclass(slots=True)
class _TenantState:
    in_flight: int = 0
    window: deque = field(default_factory=deque)  # (granted_at, tokens), oldest first
    window_tokens: int = 0


class Lease:
    """One admitted request's share of its tenant's concurrency; release exactly once."""

    __slots__ = ("_limiter", "tenant", "_released")

    def __init__(self, limiter: "TenantLimiter", tenant: str):
        self._limiter = limiter
        self.tenant = tenant
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self.tenant)


class TenantLimiter:
    """Admission control per tenant (single asyncio loop; no locks needed).

    Args:
        default: limits of every tenant without an override.
        overrides: {tenant: {limit name: value}} applied over ``default``.
        window_s: length of the tokens-per-minute window (default 60 s).
        clock: monotonic seconds (tests pass a fake clock).
        fleet_context: the longest context (tokens) a backend reports now, None when none
            does; read at most once per ``FLEET_REFRESH_S`` for ``FOLLOW_FLEET`` limits.
    """

    def __init__(
        self,
        default: TenantLimits = TenantLimits(),
        overrides: dict[str, dict[str, int]] | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        fleet_context: Callable[[], int | None] | None = None,
    ):
        self.default = default
        self._limits = {t: replace(default, **o) for t, o in (overrides or {}).items()}
        self.window_s = window_s
        self.clock = clock
        self.fleet_context = fleet_context
        self._fleet: tuple[float, int] | None = None  # (read at, prompt limit)
        self._state: dict[str, _TenantState] = {}

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self.default)

    def in_flight(self, tenant: str) -> int:
        state = self._state.get(tenant)
        return state.in_flight if state else 0

    def max_prompt_tokens(self, tenant: str) -> int:
        """The longest prompt ``tenant`` may send now (0: no limit), ``FOLLOW_FLEET``
        resolved to the backends' context."""
        limit = self.limits(tenant).max_prompt_tokens
        if limit != FOLLOW_FLEET:
            return limit
        now = self.clock()
        if self._fleet is None or now - self._fleet[0] >= FLEET_REFRESH_S:
            context = self.fleet_context() if self.fleet_context is not None else None
            self._fleet = (now, context or FLEET_UNKNOWN_PROMPT_TOKENS)
        return self._fleet[1]

    def check_prompt(self, tenant: str, num_tokens: int) -> None:
        """Raise LimitExceeded("invalid") when one prompt is longer than the tenant may send."""
        lim = self.limits(tenant)
        max_prompt = self.max_prompt_tokens(tenant)
        if max_prompt and num_tokens > max_prompt:
            source = ": the backends' context" if lim.max_prompt_tokens == FOLLOW_FLEET else ""
            raise LimitExceeded(
                "invalid",
                "max_prompt_tokens",
                f"prompt has {num_tokens} tokens; tenant {tenant!r} may send at most {max_prompt} "
                f"(limit max_prompt_tokens{source})",
            )
        if lim.tokens_per_minute and num_tokens > lim.tokens_per_minute:
            raise LimitExceeded(
                "invalid",
                "tokens_per_minute",
                f"prompt has {num_tokens} tokens, more than tenant {tenant!r} may send in a minute "
                f"({lim.tokens_per_minute}, limit tokens_per_minute)",
            )

    def acquire(self, tenant: str, num_tokens: int) -> Lease:
        """Admit one request of ``num_tokens`` prompt tokens or raise LimitExceeded.

        Checks the prompt size, the tenant's concurrency and its token window; only when
        all pass does it count the request (so a refusal changes nothing).
        """
        self.check_prompt(tenant, num_tokens)
        lim = self.limits(tenant)
        state = self._state.get(tenant)
        if state is None:
            state = self._state[tenant] = _TenantState()
        if lim.max_concurrent and state.in_flight >= lim.max_concurrent:
            raise LimitExceeded(
                "overloaded",
                "max_concurrent",
                f"tenant {tenant!r} already has {state.in_flight} requests in flight "
                f"(limit max_concurrent={lim.max_concurrent}); retry when one finishes",
            )
        if lim.tokens_per_minute:
            now = self.clock()
            self._expire(state, now)
            if state.window_tokens + num_tokens > lim.tokens_per_minute:
                raise LimitExceeded(
                    "overloaded",
                    "tokens_per_minute",
                    f"tenant {tenant!r} sent {state.window_tokens} prompt tokens in the last {self.window_s:.0f} s "
                    f"(limit tokens_per_minute={lim.tokens_per_minute}); retry later",
                )
            state.window.append((now, num_tokens))
            state.window_tokens += num_tokens
        state.in_flight += 1
        return Lease(self, tenant)

    def _expire(self, state: _TenantState, now: float) -> None:
        horizon = now - self.window_s
        while state.window and state.window[0][0] <= horizon:
            state.window_tokens -= state.window.popleft()[1]

    def _release(self, tenant: str) -> None:
        state = self._state[tenant]
        state.in_flight -= 1
        assert state.in_flight >= 0, tenant
        if state.in_flight == 0 and not state.window:
            del self._state[tenant]  # idle tenants cost no memory


def limiter_from_config(max_concurrent: int, max_prompt_tokens: int, tokens_per_minute: int, overrides: str,
                        fleet_context: Callable[[], int | None] | None = None) -> TenantLimiter:
    """Build the limiter from the router's ``tenant_*`` settings; ``fleet_context``: the
    backends' longest reported context (``FOLLOW_FLEET``)."""
    return TenantLimiter(TenantLimits(max_concurrent, max_prompt_tokens, tokens_per_minute), parse_tenant_limits(overrides),
                         fleet_context=fleet_context)
