"""Router configuration: one dataclass, three sources.

Every field of ``RouterConfig`` can be set (lowest to highest precedence) by its default,
a key of the optional YAML/JSON config file (``--config`` or ``UNICACHE_CONFIG``), the
environment variable ``UNICACHE_<FIELD NAME IN CAPITALS>``, and the command-line flag
``--<field-name-with-dashes>``. The flags are generated from the fields, so a new setting
needs exactly one line here.

The config validates itself: ``RouterConfig.validate`` (``build_config`` calls it) refuses
a setting that cannot work with a UsageError naming it, and ``follows_redis`` decides
whether Redis is followed; ``RouterApp`` only wires what they allow.

Secrets (``salt_secret``, ``redis_password``, ``api_keys``) are never included in
``describe()`` output, logs or error messages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from unicache.contract.endpoints import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from unicache.contract.redis_keys import DEFAULT_PREFIX
from unicache.contract.state_auth import parse_cluster_key
from unicache.plumbing import settings
from unicache.plumbing.errors import UsageError
from unicache.plumbing.tls import insecure_transport
from unicache.router.routing.registry import ROUTING_POLICIES
from unicache.router.upstream.replica_client import TRANSPORTS
from unicache.router.upstream.vllm_fleet.events_listener import parse_listen
from unicache.router.upstream.vllm_fleet.fleet import parse_discovery
from unicache.router.upstream.vllm_fleet.spec import BackendSpec, backend_entries, parse_backends

log = logging.getLogger(__name__)
SECRET_FIELDS = frozenset({"salt_secret", "redis_password", "api_keys", "cluster_key", "admin_key"})


@dataclass(slots=True)
class RouterConfig:
    """All router settings (see the module docstring for how each is set)."""

    grpc_host: str = field(default="127.0.0.1", metadata={"help": "gRPC bind address"})
    grpc_port: int = field(default=DEFAULT_GRPC_PORT, metadata={"help": "gRPC port (0 picks a free one)"})
    http_host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    http_port: int = field(default=DEFAULT_HTTP_PORT, metadata={"help": "HTTP port (0 picks a free one)"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL (rediss:// for TLS)"})
    redis_prefix: str = field(default=DEFAULT_PREFIX, metadata={"help": "Redis key prefix"})
    redis_password: str = field(default="", metadata={"help": "Redis password (secret)"})
    redis_password_file: str = field(default="", metadata={"help": "file holding the Redis password"})
    cluster_key: str = field(
        default="", metadata={"help": "cluster key (secret, hex): verifies replica state and authenticates calls to replicas; required with Redis"}
    )
    cluster_key_file: str = field(default="", metadata={"help": "file holding the cluster key"})
    redis_tls_ca: str = field(default="", metadata={"help": "CA bundle for rediss:// URLs"})
    replica_tls_ca: str = field(default="", metadata={"help": "mutual TLS with replicas: the cluster CA bundle their certificates must chain to"})
    replica_tls_cert: str = field(default="", metadata={"help": "mutual TLS with replicas: the router's client certificate (rotated files are picked up)"})
    replica_tls_key: str = field(default="", metadata={"help": "mutual TLS with replicas: the private key of replica_tls_cert (secret file)"})
    insecure_no_tls: bool = field(
        default=False,
        metadata={"help": "INSECURE opt-out: with a cluster key, talk to replicas without mutual TLS (a squatter on a dead replica's "
                          "ports gets requests and a replayable credential, a relay reads requests in clear; docs/security.md); "
                          "logged at every start, unicache_router_insecure_transport 1"},
    )
    redis_timeout_s: float = field(default=1.0, metadata={"help": "deadline of each Redis call"})
    use_redis: bool = field(default=True, metadata={"help": "follow replicas through Redis"})
    replicas: str = field(
        default="", metadata={"help": "static replicas 'id=host:port,...' (no Redis needed); 'id=host:port@hop_host:hop_port' adds the replica's framed hop"}
    )
    backends: str = field(
        default="",
        metadata={"help": "stock vLLM OpenAI servers to route to: 'URL,kv-events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,id=NAME]', "
                          "several separated by ';' (a config file takes a list; the flag --backend repeats); docs/vllm-backends.md"},
    )
    backend_discovery: str = field(
        default="",
        metadata={"help": "vLLM backends found by DNS (a Kubernetes headless Service): "
                          "'dns://NAME:HTTP_PORT?kv-events=PORT&replay=PORT&interval=S', or by the Kubernetes API (the ready "
                          "endpoints of the EndpointSlices a label selector picks, watched): "
                          "'k8s://NAMESPACE?selector=app=vllm&port=http&kv-events=5557&replay=5558'; docs/vllm-backends.md"},
    )
    backend_models_interval_s: float = field(
        default=60.0,
        metadata={"help": "how often each vLLM backend's /v1/models is read again: the models and LoRA adapters it lists "
                          "(adapters loaded at run time too) are where requests naming them go"},
    )
    backend_metrics_interval_s: float = field(
        default=5.0,
        metadata={"help": "how often each vLLM backend's /metrics (its load and pool) is scraped once it joined; its events "
                          "and requests are its liveness, /health is asked only when a scrape fails (docs/vllm-backends.md)"},
    )
    kv_events_listen: str = field(
        default="",
        metadata={"help": "bind one socket, tcp://*:PORT, that vLLM servers publish their KV events to (their --kv-events-config "
                          "endpoint tcp://ROUTER:PORT), each stream told apart by its topic: a backend's kv-topic=, its id, or "
                          "llm-d's kv@<pod-ip>@<model> (docs/vllm-backends.md)"},
    )
    routing_policy: str = field(default="cache_aware", metadata={"help": "routing policy name"})
    routing_options: str = field(
        default="",
        metadata={"help": "the routing policy's own settings (cache_aware: its CacheAwareConfig fields, docs/routing.md): "
                          "JSON {name: value} or 'name=value,...' (a config file takes a mapping; the flag --routing-option repeats)"},
    )
    workers: int = field(
        default=1, metadata={"help": "router processes sharing the listening ports (SO_REUSEPORT) and, through Redis, session placement; >1 needs fixed ports"}
    )
    reuse_port: bool = field(
        default=False, metadata={"help": "set SO_REUSEPORT on both listening sockets so several router processes share them (--workers sets it)"}
    )
    shared_sessions: str = field(
        default="auto",
        metadata={
            "help": "share explicit sessions' placement with the cluster's other routers through Redis (router/cluster/session_store.py): "
            "on, off, or auto (on when several router processes share the ports: --workers > 1 or --reuse-port; "
            "the Helm chart sets on when it runs more than one router pod). Each shared turn costs a Redis read and write"
        },
    )
    share_terms: bool = field(
        default=True,
        metadata={"help": "where sessions are shared, also share the routing policy's traffic-derived terms (churn, session footprint) "
                          "and the requests in flight per replica with the other routers through a Redis stream "
                          "(router/cluster/terms_exchange.py), so each decides as one router routing all the traffic would"},
    )
    terms_interval_s: float = field(
        default=0.05, metadata={"help": "how often a router sends its routed events to the other routers and applies theirs"}
    )
    session_ttl_s: float = field(default=3600.0, metadata={"help": "a shared session record expires this long after the session's latest turn"})
    session_timeout_s: float = field(
        default=0.05, metadata={"help": "deadline of a shared-session Redis read/write on the request path (beyond it the turn uses this router's memory)"}
    )
    auth_enabled: bool = field(default=True, metadata={"help": "require API keys (off: every request is tenant 'default')"})
    api_keys: str = field(default="", metadata={"help": "API keys 'key1:tenantA,key2:tenantB' (secret)"})
    api_keys_file: str = field(default="", metadata={"help": "file of 'key:tenant' lines or a JSON object"})
    salt_secret: str = field(default="", metadata={"help": "server secret the tenant cache salts derive from"})
    salt_secret_file: str = field(default="", metadata={"help": "file holding the salt secret"})
    admin_key: str = field(
        default="", metadata={"help": "if set, /metrics, /v1/cluster/state and /dashboard need 'Authorization: Bearer ADMIN_KEY' (secret)"}
    )
    admin_key_file: str = field(default="", metadata={"help": "file holding the admin key"})
    replica_transport: str = field(
        default="auto",
        metadata={"help": "how requests reach the replicas: auto (the framed hop, unicache/contract/hop.py, where a replica's heartbeat "
                          "advertises one; gRPC elsewhere) or grpc (always gRPC)"},
    )
    forward_deadline_s: float = field(
        default=300.0, metadata={"help": "deadline of a request at the router, retries included (a gRPC client's own deadline wins if earlier)"}
    )
    first_token_timeout_s: float = field(
        default=60.0,
        metadata={"help": "ceiling of the first-token timeout derived from each replica's measured TTFT; a replica that streams nothing that long is quarantined and the request retried elsewhere (0: no first-token timeout)"},
    )
    first_token_timeout_floor_s: float = field(default=5.0, metadata={"help": "floor of the derived first-token timeout"})
    first_token_timeout_multiplier: float = field(
        default=3.0, metadata={"help": "derived first-token timeout = multiplier x (TTFT mean + 4 mean deviations), within floor and ceiling"}
    )
    retry_replicas: int = field(
        default=2, metadata={"help": "failures before the first token are retried on up to this many other replicas (0: no retry)"}
    )
    quarantine_initial_s: float = field(
        default=0.5, metadata={"help": "first re-probe of a quarantined replica (refused or stalled) after this; doubles per failed probe"}
    )
    quarantine_max_s: float = field(default=30.0, metadata={"help": "bound of the quarantine re-probe interval"})
    served_model_name: str = field(
        default="unicache-default", metadata={"help": "the model name served (/v1/models); requests naming another get 404 model_not_found"}
    )
    block_size: int = field(default=16, metadata={"help": "KV block size in tokens (must match the replicas)"})
    tokenizer: str = field(
        default="", metadata={"help": "tokenizer.json path, or 'byte'; empty: the checkpoint's tokenizer.json, else bytes (as the replicas)"}
    )
    checkpoint: str = field(default="", metadata={"help": "the replicas' checkpoint dir (only its tokenizer.json is read)"})
    prefix_tokens_kept: int = field(
        default=1_000_000,
        metadata={"help": "token ids of recently seen prompt prefixes kept (about 4 bytes each plus the text), so a chat's new "
                          "turn, or a completion prompt sharing a long head with a recent one, tokenizes only its new part "
                          "(router/request_path/prefix_tokens.py); 0: tokenize every prompt whole"},
    )
    memory_budget_mib: int = field(
        default=256, metadata={"help": "RSS budget of one router process: the classifier's and the policy's tables are capped to fit it (router/memory.py)"}
    )
    max_index_blocks: int = field(default=2_000_000, metadata={"help": "locality index bound per replica"})
    max_in_flight: int = field(default=4096, metadata={"help": "requests in flight before answering 429"})
    max_request_bytes: int = field(
        default=8 << 20, metadata={"help": "largest HTTP body / gRPC message accepted (413 / RESOURCE_EXHAUSTED beyond)"}
    )
    http_header_timeout_s: float = field(default=10.0, metadata={"help": "HTTP: time to send a complete request head (408 and close beyond)"})
    http_body_timeout_s: float = field(default=30.0, metadata={"help": "HTTP: time to send the body once the head is in (408 and close beyond)"})
    http_keepalive_timeout_s: float = field(default=5.0, metadata={"help": "HTTP: idle time between requests on a kept-alive connection"})
    http_max_connections: int = field(default=4096, metadata={"help": "HTTP: open connections beyond which new ones get 503"})
    http_parser: str = field(default="auto", metadata={"help": "HTTP parser: auto (httptools if installed), httptools, h11"})
    http_idle_timeout_s: float = field(default=2.0, metadata={"help": "HTTP: time from accept to a connection's first byte (closed beyond)"})
    http_max_header_bytes: int = field(default=32 << 10, metadata={"help": "HTTP: largest request head in bytes (431 beyond)"})
    http_max_headers: int = field(default=100, metadata={"help": "HTTP: most header fields in one request (431 beyond)"})
    http_max_connections_per_peer: int = field(
        default=1024, metadata={"help": "HTTP: connections one client address may hold (503 beyond unless one of its idle ones can close; 0: no share; raise it behind a proxy)"}
    )
    event_loop: str = field(
        default="auto",
        metadata={"help": "`unicache router` event loop: auto (uvloop when installed: less CPU per request, bench.router_profile), uvloop, asyncio"},
    )
    tenant_max_concurrent: int = field(default=1024, metadata={"help": "requests one tenant may have in flight (429 beyond; 0: no limit)"})
    tenant_max_prompt_tokens: int = field(
        default=-1, metadata={"help": "prompt tokens per request (400 beyond; -1: the backends' reported context, max_model_len, 32768 until one reports it; 0: no limit)"}
    )
    tenant_tokens_per_minute: int = field(default=0, metadata={"help": "prompt tokens one tenant may send per minute (429 beyond; 0: no limit)"})
    tenant_limits: str = field(
        default="", metadata={"help": "per-tenant overrides: JSON {tenant: {max_concurrent, max_prompt_tokens, tokens_per_minute}} or 'tenant.limit=N,...'"}
    )
    overload_backend_queue: int = field(
        default=1024, metadata={"help": "requests one backend may have queued (accepted, not started); 429 when every backend is full (0: no bound)"}
    )
    overload_backend_queue_tokens: float = field(
        default=4.0, metadata={"help": "prompt tokens one backend may have queued, in multiples of its reported KV capacity in tokens (0: no bound)"}
    )
    overload_fleet_queue: int = field(default=0, metadata={"help": "requests queued across the fleet before 429 (0: the sum of the backends' bounds)"})
    overload_fleet_queue_tokens: int = field(
        default=0, metadata={"help": "prompt tokens queued across the fleet before 429 (0: the sum of the backends' bounds)"}
    )
    overload_max_wait_s: float = field(
        default=20.0, metadata={"help": "longest expected time to first token of an admitted request, seconds (the fitted costs or the backend's queue at its measured drain rate); beyond it at every backend, 429 (0: only the request's deadline bounds it)"}
    )
    overload_cold_queue: int = field(
        default=0, metadata={"help": "requests one backend may have queued while its wait is not measured yet (no fitted costs, no drain rate); 429 when every backend is there (0: no bound: a fresh router refuses nothing on a guess)"}
    )
    overload_retry_after_s: int = field(
        default=0, metadata={"help": "Retry-After of an overload refusal, seconds (0: the TTFT the fitted costs predict at the least loaded backend, 1-60)"}
    )

    def describe(self) -> dict[str, Any]:
        """Settings with secrets masked, safe to log."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET_FIELDS:
                value = "***" if value else ""
            elif f.name == "redis_url":
                value = mask_url_password(value)
            out[f.name] = value
        return out

    def resolve_secrets(self) -> "RouterConfig":
        """Fill each empty secret from its ``*_file`` setting (in place; returns self)."""
        for name in ("redis_password", "cluster_key", "salt_secret", "admin_key"):
            setattr(self, name, settings.resolve_secret(getattr(self, name), getattr(self, name + "_file"), name))
        return self

    def validate(self) -> None:
        """UsageError naming the setting for any setting that cannot work; nothing else.

        ``build_config`` calls it on what it merged. It checks the settings alone: the
        cluster key, which may be absent when only vLLM backends are routed, is checked
        where the router decides whether to follow Redis (``follows_redis``).
        """
        self.backend_specs()  # a bad entry is a UsageError now, not at start-up
        if self.backend_discovery:
            parse_discovery(self.backend_discovery)
        if self.block_size <= 0:
            raise UsageError("block_size must be positive")
        if self.backend_models_interval_s <= 0:
            raise UsageError(f"backend_models_interval_s must be positive, got {self.backend_models_interval_s}")
        if self.backend_metrics_interval_s <= 0:
            raise UsageError(f"backend_metrics_interval_s must be positive, got {self.backend_metrics_interval_s}")
        if self.prefix_tokens_kept < 0:
            raise UsageError(f"prefix_tokens_kept must be >= 0, got {self.prefix_tokens_kept}")
        if self.kv_events_listen:
            parse_listen(self.kv_events_listen)
            if self.workers > 1:
                raise UsageError("kv_events_listen binds one socket, which one process holds: run it with --workers 1")
        if self.memory_budget_mib < 64:
            raise UsageError(f"memory_budget_mib must be >= 64, got {self.memory_budget_mib}")
        if self.workers < 1:
            raise UsageError(f"workers must be >= 1, got {self.workers}")
        if self.workers > 1 and (self.grpc_port == 0 or self.http_port == 0):
            raise UsageError("--workers > 1 needs fixed --grpc-port and --http-port (with port 0 each process would pick its own)")
        shares_sessions(self)  # a bad value is a UsageError now, not at start-up
        if self.session_ttl_s <= 0 or self.session_timeout_s <= 0 or self.terms_interval_s <= 0:
            raise UsageError("session_ttl_s, session_timeout_s and terms_interval_s must be positive")
        check_routing_policy(self.routing_policy)
        self.policy_options()  # unknown names and values out of range are a UsageError now
        check_http_settings(self)
        tls = (self.replica_tls_ca, self.replica_tls_cert, self.replica_tls_key)
        if any(tls) and not all(tls):
            raise UsageError("mutual TLS with replicas needs all of replica_tls_ca, replica_tls_cert and replica_tls_key")
        if self.replica_transport not in TRANSPORTS:
            raise UsageError(f"replica_transport must be one of {', '.join(TRANSPORTS)}, got {self.replica_transport!r}")
        self.check_redis()

    def check_redis(self) -> None:
        """UsageError for Redis settings that cannot work while ``use_redis``: a URL that
        is not Redis, a TLS CA without ``rediss://``."""
        if self.use_redis and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise UsageError("redis_url must start with redis://, rediss:// or unix://")
        if self.use_redis and self.redis_tls_ca and not self.redis_url.startswith("rediss://"):
            raise UsageError("redis_tls_ca needs a rediss:// redis_url")

    def follows_redis(self) -> bool:
        """Whether the router follows replicas through Redis: ``use_redis``, unless there
        is no cluster key and it routes vLLM backends (their own events feed the index).
        UsageError for Redis settings that cannot work (``check_redis``) and for following
        Redis without the cluster key: only state signed with it is trusted."""
        if not self.use_redis:
            return False
        self.check_redis()
        if self.cluster_key_bytes() is not None:
            return True
        if self.backend_specs() or self.backend_discovery:
            # NOTE: a fleet of stock vLLM servers needs no Redis: their own events feed the
            # index. Replicas of ours would need the key; without it none are followed.
            log.info("no cluster key: not following replicas through Redis; routing vLLM backends only")
            return False
        raise UsageError(
            "following replicas through Redis needs the cluster key (set UNICACHE_CLUSTER_KEY or --cluster-key-file): "
            "only state signed with it is trusted"
        )

    def insecure_transport(self) -> bool:
        """Whether this router talks to replicas without mutual TLS by the explicit
        ``insecure_no_tls`` opt-out (a warning logged each call: at every start).
        UsageError naming the fix for a cluster key without the replica TLS files and
        without the opt-out (``unicache.plumbing.tls.insecure_transport``)."""
        return insecure_transport(
            component="the router", keyed=self.cluster_key_bytes() is not None, has_tls=bool(self.replica_tls_cert),
            insecure=self.insecure_no_tls, tls_settings="replica_tls_ca, replica_tls_cert and replica_tls_key",
        )

    def cluster_key_bytes(self) -> bytes | None:
        if not self.cluster_key:
            return None
        try:
            return parse_cluster_key(self.cluster_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def policy_options(self) -> dict[str, Any]:
        """``routing_options`` parsed and typed for ``routing_policy`` (``parse_routing_options``)."""
        return parse_routing_options(self.routing_policy, self.routing_options)

    def backend_specs(self) -> list[BackendSpec]:
        """``backends`` parsed (``unicache.router.upstream.vllm_fleet.spec``); UsageError if malformed."""
        return parse_backends(self.backends)

    def static_replicas(self) -> dict[str, tuple[str, str]]:
        """Parse ``replicas`` into {replica_id: (gRPC address, hop address or "")}: entries
        are ``id=host:port`` or ``id=host:port@hop_host:hop_port`` (the replica's framed hop)."""
        out: dict[str, tuple[str, str]] = {}
        for item in filter(None, (p.strip() for p in self.replicas.split(","))):
            rid, sep, addr = item.partition("=")
            addr, at, hop = addr.partition("@")
            if not sep or not rid or not addr or (at and not hop):
                raise UsageError(f"bad --replicas entry {item!r}: expected id=host:port or id=host:port@hop_host:hop_port")
            out[rid] = (addr, hop)
        return out


def resolve_tokenizer_path(cfg: RouterConfig) -> str | None:
    """The tokenizer file the replicas use, by their rule (replica/engines/builtin/config.py):
    an explicit tokenizer, else the checkpoint's ``tokenizer.json``, else bytes (None).

    A checkpoint the router cannot read is a UsageError: guessing bytes would send the
    model wrong token ids and hash prompts differently from the replicas.
    """
    if cfg.tokenizer == "byte":
        return None
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.checkpoint:
        if not os.path.isdir(cfg.checkpoint):
            raise UsageError(
                f"checkpoint {cfg.checkpoint} is not readable from the router: mount it, or set --tokenizer "
                "to its tokenizer.json (or 'byte' if the replicas tokenize bytes)"
            )
        path = os.path.join(cfg.checkpoint, "tokenizer.json")
        return path if os.path.exists(path) else None
    return None


def mask_url_password(url: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:***@host`` and ``?password=pw`` ->
    ``?password=***`` (redis-py reads both), for logs."""
    url = re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, one flag per field (unset flags stay ``None``), the repeatable
    ``--backend`` (each adds one entry to ``backends``) and the repeatable
    ``--routing-option NAME=VALUE`` (each sets one of ``routing_options``)."""
    settings.add_arguments(parser, RouterConfig, secrets=SECRET_FIELDS)
    parser.add_argument(
        "--routing-option", dest="routing_option_list", action="append", default=None, metavar="NAME=VALUE",
        help="one setting of the routing policy (repeat for several; adds to --routing-options)",
    )
    parser.add_argument(
        "--backend", dest="backend_list", action="append", default=None, metavar="URL,kv-events=tcp://HOST:PORT",
        help="a stock vLLM OpenAI server and its KV events address (repeat for several; adds to --backends)",
    )


def build_config(
    args: argparse.Namespace | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> RouterConfig:
    """Merge defaults < config file < environment < flags < ``overrides``."""
    cfg = settings.build(RouterConfig, args, env, overrides, secrets=SECRET_FIELDS).resolve_secrets()
    extra = getattr(args, "backend_list", None) or []
    if extra:
        cfg.backends = json.dumps([*backend_entries(cfg.backends), *extra])
    options = getattr(args, "routing_option_list", None) or []
    if options:
        merged = parse_routing_options(cfg.routing_policy, cfg.routing_options)
        merged.update(parse_routing_options(cfg.routing_policy, ",".join(options)))
        cfg.routing_options = json.dumps(merged)
    cfg.validate()
    return cfg


SHARED_SESSIONS_VALUES = ("auto", "on", "off")


def shares_sessions(cfg: RouterConfig) -> bool:
    """Whether this router keeps explicit sessions' placement in Redis.

    ``auto`` means on exactly when this process shares its ports with other router
    processes (``reuse_port``, which ``--workers`` > 1 sets on every worker): a lone
    router's own memory already gives every turn the same answer, and the store would
    cost it a Redis read and write per turn (``bench.session_store_cost``). Several pods
    are invisible from inside one, so the chart sets ``on`` for them. ``true``/``false``
    (and the other spellings ``parse_bool`` reads) mean on/off.
    """
    value = str(cfg.shared_sessions).strip().lower()
    if value == "auto":
        return cfg.reuse_port or cfg.workers > 1
    try:
        return settings.parse_bool(value)
    except ValueError:
        raise UsageError(f"shared_sessions must be one of {', '.join(SHARED_SESSIONS_VALUES)}, got {cfg.shared_sessions!r}") from None


def check_http_settings(cfg: RouterConfig) -> None:
    """``UsageError`` for non-positive HTTP limits or an unknown/missing parser or loop."""
    from unicache.router.frontends.http_server import loop_factory, parser_protocol

    for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keepalive_timeout_s", "http_max_connections",
                 "http_idle_timeout_s", "http_max_header_bytes", "http_max_headers"):
        if not getattr(cfg, name) > 0:
            raise UsageError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.http_max_connections_per_peer < 0:
        raise UsageError(f"http_max_connections_per_peer must be >= 0, got {cfg.http_max_connections_per_peer}")
    parser_protocol(cfg.http_parser)
    loop_factory(cfg.event_loop)


def parse_routing_options(policy: str, text: str) -> dict[str, Any]:
    """The routing policy's settings from ``text`` (a JSON object, or ``name=value`` items
    separated by commas), each converted to the type of the policy's config field and the
    whole checked by building the config. UsageError naming the setting: an unknown name
    (with the valid ones), a value of the wrong type, or one the config refuses."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"routing_options: not a JSON object ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise UsageError("routing_options: not a JSON object")
    else:
        raw = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise UsageError(f"routing_options: bad entry {item!r}: expected name=value")
            raw[name.strip()] = value.strip()
    check_routing_policy(policy)
    cls = ROUTING_POLICIES.get(policy)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise UsageError(f"routing_options: routing policy {policy!r} takes no settings")
    kinds = settings.field_types(config_class)
    unknown = sorted(set(raw) - set(kinds))
    if unknown:
        raise UsageError(f"routing_options: {policy} has no setting {', '.join(unknown)} (its settings: {', '.join(kinds)})")
    out = {}
    for name, value in raw.items():
        kind = kinds[name]
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise UsageError(f"routing_options: {name} must be int, got {value!r}")
        out[name] = settings.convert(name, kind, value, "routing_options")
    try:
        config_class(**out)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"routing_options: {exc}") from None
    return out


def check_routing_policy(name: str) -> None:
    """``UsageError`` naming the valid routing policies unless ``name`` is one."""
    try:
        ROUTING_POLICIES.get(name)
    except ValueError as exc:
        raise UsageError(f"routing_policy: {exc}") from None
