"""``RouterApp``: composes config, auth, tokenizer, classifier, policy, index, Redis
subscriber, replica clients and both front doors, and runs them on one asyncio loop.

Ports given as 0 are chosen by the OS and read back (``grpc_port``, ``http_port``) after
``start()``. ``stop()`` undoes everything ``start()`` did, in reverse order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from unicache.contract.state_auth import CallCredential, StateSigner
from unicache.contract.tokenizer import load_tokenizer
from unicache.plumbing.aio import cancel_and_wait
from unicache.plumbing.errors import UsageError
from unicache.plumbing.grpc_decode import add_servicer
from unicache.plumbing.grpc_server import pending_call_options
from unicache.plumbing.tls import client_tls
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.models import fleet_context
from unicache.router.cluster.prober import QuarantineProber
from unicache.router.cluster.rejections import StateRejections
from unicache.router.cluster.session_store import SessionStore
from unicache.router.cluster.subscriber import RedisSubscriber
from unicache.router.cluster.terms_exchange import TermsExchange
from unicache.router.cluster.view import ClusterView
from unicache.router.config import RouterConfig, resolve_tokenizer_path, shares_sessions
from unicache.router.frontends.grpc_service import RouterServicer
from unicache.router.frontends.http_api import HttpFrontDoor
from unicache.router.frontends.http_server import HttpLimits, QuietServer, parser_protocol, uvicorn_config
from unicache.router.memory import TableCaps
from unicache.router.observability.history import ClusterHistory
from unicache.router.observability.metrics import RouterMetrics
from unicache.router.request_path.auth import Authenticator, load_api_keys_file, parse_api_keys
from unicache.router.request_path.classifier import RequestClassifier
from unicache.router.request_path.core import RouterCore
from unicache.router.request_path.cost_observer import CostObserver
from unicache.router.request_path.first_token import FirstTokenTimeout
from unicache.router.request_path.limits import limiter_from_config
from unicache.router.request_path.overload import OverloadConfig, OverloadGuard
from unicache.router.request_path.prefix_tokens import PrefixReusingTokenizer
from unicache.router.routing.base import RoutingPolicy, SharesRouterState
from unicache.router.routing.registry import make_routing_policy, routing_policy_parameters
from unicache.router.upstream.replica_client import ReplicaClients
from unicache.router.upstream.vllm_fleet.events_listener import EventsListener
from unicache.router.upstream.vllm_fleet.fleet import VllmFleet
from unicache.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "unicache.v1.Router"
FALLBACK_POLICY = "round_robin"


def cost_observer(cluster: ClusterView, policy: RoutingPolicy, metrics: RouterMetrics) -> CostObserver:
    """The observer that feeds ``cluster.cost_model`` from every request (and the TTFT
    prediction error metric); a policy that prices in seconds (``set_cost_model``) reads
    that model."""
    if hasattr(policy, "set_cost_model"):
        policy.set_cost_model(cluster.cost_model)
    config = getattr(policy, "config", None)
    shares = policy.queue_shares if isinstance(policy, SharesRouterState) else None
    return CostObserver(cluster.cost_model, getattr(config, "prefill_lanes", 4), shares, metrics.observe_prediction,
                        on_overdue=metrics.observe_overdue)


def build_policy(name: str, caps: TableCaps | None = None, options: dict | None = None) -> RoutingPolicy:
    """``make_routing_policy(name, **options)``, its session tables capped by ``caps`` when
    it has them (unless ``options``, the operator's ``routing_options``, set them); the
    default ``cache_aware`` falls back to round robin while it is not registered. Unknown
    names are a UsageError."""
    try:
        kwargs = {}
        if caps is not None:
            params = routing_policy_parameters(name)
            if "max_session_blocks" in params:
                kwargs["max_session_blocks"] = caps.policy_session_blocks
            if "max_sessions" in params:
                kwargs["max_sessions"] = caps.classifier_sessions
        return make_routing_policy(name, **{**kwargs, **(options or {})})
    except ValueError as exc:
        if name == "cache_aware":
            log.warning("routing policy cache_aware not available; using %s", FALLBACK_POLICY)
            return make_routing_policy(FALLBACK_POLICY)
        raise UsageError(str(exc)) from None


def build_authenticator(cfg: RouterConfig) -> Authenticator:
    keys: dict[str, str] = {}
    if cfg.api_keys_file:
        keys.update(load_api_keys_file(cfg.api_keys_file))
    if cfg.api_keys:
        keys.update(parse_api_keys(cfg.api_keys))
    return Authenticator(keys, cfg.salt_secret, enabled=cfg.auth_enabled)


class RouterApp:
    """The router process.

    Args:
        config: settings (``unicache.router.config``), validated by ``build_config``
            (``RouterConfig.validate``); whether Redis is followed is the config's call
            (``RouterConfig.follows_redis``).
        policy: a routing policy object (default: built from ``config.routing_policy``).
        subscriber_kwargs: extra ``RedisSubscriber`` arguments, which replace the defaults
            (tests shorten intervals, or answer ``fetch_summary`` for simulated replicas).
    """

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None, subscriber_kwargs: dict | None = None):
        self.config = config.resolve_secrets()
        self.table_caps = TableCaps.for_budget(config.memory_budget_mib)
        self.policy = policy or build_policy(config.routing_policy, self.table_caps, config.policy_options())
        self.index = LocalityIndex(config.max_index_blocks)
        self.cluster = ClusterView(
            self.policy, self.index, quarantine_initial_s=config.quarantine_initial_s, quarantine_max_s=config.quarantine_max_s
        )
        self.auth = build_authenticator(config)
        path = resolve_tokenizer_path(config)
        try:
            tokenizer = load_tokenizer(path)
        except Exception as exc:  # noqa: BLE001 - any load failure is a configuration error
            raise UsageError(f"cannot load tokenizer {path}: {exc}") from None
        if config.prefix_tokens_kept and hasattr(tokenizer, "split_tokens"):
            tokenizer = PrefixReusingTokenizer(tokenizer, config.prefix_tokens_kept)
        self.metrics = RouterMetrics()
        if isinstance(tokenizer, PrefixReusingTokenizer):
            for kind in ("hits", "misses", "reused_tokens", "kept_tokens", "mismatches"):
                self.metrics.prefix_reuse.labels(kind).set_function(functools.partial(getattr, tokenizer, kind))
        self.metrics.insecure_transport.set(1 if config.insecure_transport() else 0)
        cluster_key = config.cluster_key_bytes()
        self.clients = ReplicaClients(
            config.forward_deadline_s, credential=CallCredential(cluster_key) if cluster_key else None,
            cluster_key=cluster_key or None, transport=config.replica_transport, hop_counter=self.metrics.hop_connections,
            tls=client_tls(config.replica_tls_ca, config.replica_tls_cert, config.replica_tls_key),
        )
        self.state_rejections = StateRejections(self.metrics.registry)
        first_token = None
        if config.first_token_timeout_s > 0:
            first_token = FirstTokenTimeout(
                config.first_token_timeout_s, config.first_token_timeout_floor_s, config.first_token_timeout_multiplier
            )
        self.subscriber: RedisSubscriber | None = None
        self.backend_specs = config.backend_specs()
        if config.follows_redis():
            self.subscriber = RedisSubscriber(
                self.cluster,
                config.redis_url,
                config.redis_prefix,
                password=config.redis_password or None,
                tls_ca=config.redis_tls_ca or None,
                timeout_s=config.redis_timeout_s,
                expected_block_size=config.block_size,
                **{
                    "signer": StateSigner(cluster_key),
                    "fetch_summary": self.clients.cache_summary,
                    "rejections": self.state_rejections,
                    **(subscriber_kwargs or {}),
                },
            )
        self.sessions: SessionStore | None = None
        # NOTE: only a policy that shares router state (``SharesRouterState``: it remembers
        # sessions) has anything to share; for the others (round robin, session_affinity's
        # ring) the store would cost Redis calls for nothing.
        if self.subscriber is not None and shares_sessions(config) and isinstance(self.policy, SharesRouterState):
            self.sessions = SessionStore(
                self.subscriber.new_client(), config.redis_prefix, cluster_key, timeout_s=config.session_timeout_s,
                ttl_s=config.session_ttl_s, counter=self.metrics.session_store,
            )
        # NOTE: the routers that share sessions share the policy's traffic-derived terms
        # too (churn, footprint), so each decides as one router routing everything would.
        self.terms: TermsExchange | None = None
        if self.sessions is not None and config.share_terms:
            self.terms = TermsExchange(
                self.subscriber.new_client(), config.redis_prefix, cluster_key, self.policy,
                is_known=self.cluster.replicas.__contains__, interval_s=config.terms_interval_s,
                counter=self.metrics.terms_exchange, cluster=self.cluster,
            )
        costs = cost_observer(self.cluster, self.policy, self.metrics)
        self.core = RouterCore(
            self.cluster,
            self.auth,
            tokenizer,
            RequestClassifier(
                max_prompts=self.table_caps.classifier_prompts,
                max_sessions=self.table_caps.classifier_sessions,
                max_blocks=self.table_caps.classifier_blocks,
            ),
            self.clients,
            self.metrics,
            block_size=config.block_size,
            max_in_flight=config.max_in_flight,
            first_token_timeout=first_token,
            retry_replicas=config.retry_replicas,
            sessions=self.sessions,
            costs=costs,
            limits=limiter_from_config(
                config.tenant_max_concurrent, config.tenant_max_prompt_tokens, config.tenant_tokens_per_minute, config.tenant_limits,
                fleet_context=functools.partial(fleet_context, self.cluster),
            ),
            overload=OverloadGuard(
                OverloadConfig(config.overload_backend_queue, config.overload_backend_queue_tokens, config.overload_fleet_queue,
                               config.overload_fleet_queue_tokens, config.overload_retry_after_s, config.overload_max_wait_s,
                               config.overload_cold_queue),
                config.block_size, costs.predicted_ttft_s, self.metrics.registry,
            ),
        )
        # NOTE: without a first-token timeout a probe gets the forward deadline's share a
        # request would wait for its first message at most.
        self.prober = QuarantineProber(
            self.cluster, self.clients, first_token.timeout_s if first_token else lambda _rid: min(config.forward_deadline_s, 10.0)
        )
        for rid, (addr, hop) in config.static_replicas().items():
            self.cluster.upsert(rid, addr, static=True, hop_address=hop)
        self.events_listener = EventsListener(config.kv_events_listen) if config.kv_events_listen else None
        self.fleet = VllmFleet(self.cluster, self.clients.vllm, config.block_size, self.backend_specs, config.backend_discovery,
                               follower_kwargs={"models_interval_s": config.backend_models_interval_s,
                                                "metrics_interval_s": config.backend_metrics_interval_s,
                                                "listener": self.events_listener})
        self.history = ClusterHistory(self.metrics, self.cluster)
        self.http = HttpFrontDoor(
            self.core, config.served_model_name, self.policy.name, max_body_bytes=config.max_request_bytes,
            admin_key=config.admin_key, history=self.history,
        )
        self.http_limits = HttpLimits.from_config(config)
        self._http_protocol = parser_protocol(config.http_parser)
        self.grpc_port = 0
        self.http_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        cfg = self.config
        server = grpc.aio.server(
            # NOTE: the receive limit bounds what one request can make the router tokenize
            # and hash (a 64 MiB prompt became a 64M-element token list).
            options=[
                ("grpc.max_receive_message_length", cfg.max_request_bytes),
                ("grpc.max_send_message_length", 64 << 20),
                # NOTE: grpc core sets SO_REUSEPORT by default, so a second router on the
                # same port would silently share it; only --workers asks for that.
                ("grpc.so_reuseport", 1 if cfg.reuse_port else 0),
                *pending_call_options(cfg.max_in_flight),
            ]
        )
        add_servicer(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(self.core, self.policy.name, cfg.admin_key, cfg.served_model_name), server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        port = server.add_insecure_port(f"{cfg.grpc_host}:{cfg.grpc_port}")
        if port == 0:
            raise UsageError(f"cannot bind gRPC to {cfg.grpc_host}:{cfg.grpc_port}")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._grpc_server, self.grpc_port = server, port

        # NOTE: proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only
        # when proto is TCP, and without it Nagle + delayed ACK add ~40 ms per response.
        family = socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cfg.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((cfg.http_host, cfg.http_port))
        except OSError as exc:
            sock.close()
            await self.stop()
            raise UsageError(f"cannot bind HTTP to {cfg.http_host}:{cfg.http_port}: {exc.strerror}") from None
        sock.listen(1024)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        self._uvicorn = QuietServer(uvicorn_config(self.http.app, self.http_limits, self._http_protocol))
        self._uvicorn.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._tasks.append(asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name="router-http"))
        while not self._uvicorn.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()
            await asyncio.sleep(0.01)
        self._tasks.append(asyncio.create_task(self.prober.run(), name="router-prober"))
        self._tasks.append(asyncio.create_task(self.history.run(), name="router-history"))
        if self.subscriber is not None:
            self._tasks.append(asyncio.create_task(self.subscriber.run(), name="router-redis"))
        if self.terms is not None:
            self._tasks.append(asyncio.create_task(self.terms.run(), name="router-terms"))
        if self.fleet:
            self._tasks.append(asyncio.create_task(self.fleet.run(), name="router-backends"))
        log.info("router serving gRPC on %s:%d and HTTP on %s:%d", cfg.grpc_host, self.grpc_port, cfg.http_host, self.http_port)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        # The Redis follower and the prober are cancelled; uvicorn exits by itself once
        # should_exit is set.
        background = ("router-redis", "router-prober", "router-history", "router-terms", "router-backends")
        await cancel_and_wait([t for t in self._tasks if t.get_name() in background])
        http = [t for t in self._tasks if t.get_name() not in background]
        if http:
            _, late = await asyncio.wait(http, timeout=grace_s + 5)
            await cancel_and_wait(late)
        self._tasks.clear()
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace_s)
            self._grpc_server = None
        await self.clients.close()
        if self.events_listener is not None:
            self.events_listener.close()
        if self.sessions is not None:
            await self.sessions.redis.aclose()
        if self.terms is not None:
            await self.terms.redis.aclose()
        if self.subscriber is not None:
            await self.subscriber.close()

    async def serve_forever(self) -> None:
        """Start, run until cancelled (SIGINT/SIGTERM in the CLI), then stop."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()
