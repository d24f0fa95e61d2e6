"""``unicache up``: a whole cluster on this machine with nothing configured.

Starts, in order: a private ``redis-server`` (unless ``--redis-url`` is given), Ray
in-process (bound to loopback, its temp dir private to this run), N replica actors, and
the router (gRPC + HTTP). Prints one line starting with ``ready`` once the router answers
and sees every replica, then the endpoints and example requests. SIGINT/SIGTERM stop
everything in reverse order and remove every temp dir this run created.

Secrets of a run: the private Redis gets a random password and the cluster a random
cluster key (state MACs, router->replica credentials), each written to a file in this
run's private temp dir (0700; files 0600), which the replicas read (``*_file`` settings);
neither is ever printed or put on a command line. An external ``--redis-url`` brings its
own password (in the URL, or UNICACHE_REDIS_PASSWORD / redis_password_file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from unicache.contract.endpoints import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, LOCAL_ROUTER
from unicache.contract.redis_keys import DEFAULT_PREFIX
from unicache.contract.state_auth import new_cluster_key
from unicache.plumbing import settings as settings_mod
from unicache.plumbing.errors import UsageError
from unicache.plumbing.process_tree import become_subreaper, descendants, reap_below
from unicache.plumbing.redis_server import write_private
from unicache.plumbing.tls import make_cluster_pki

log = logging.getLogger("unicache.up")


DEFAULT_NUM_BLOCKS = 2048  # per replica of the built-in engine


@dataclass(slots=True)
class ClusterSettings:
    """Settings of ``unicache up`` (each also a flag, UNICACHE_<NAME> and a config-file key)."""

    num_replicas: int = field(default=2, metadata={"help": "replica actors to start"})
    grpc_port: int = field(default=DEFAULT_GRPC_PORT, metadata={"help": "router gRPC port (0 picks a free one)"})
    http_port: int = field(default=DEFAULT_HTTP_PORT, metadata={"help": "router HTTP port (0 picks a free one)"})
    host: str = field(default="127.0.0.1", metadata={"help": "interface the router binds"})
    redis_url: str = field(default="", metadata={"help": "external Redis (empty: start a private redis-server)"})
    redis_prefix: str = field(default=DEFAULT_PREFIX, metadata={"help": "Redis key prefix"})
    routing_policy: str = field(default="cache_aware", metadata={"help": "routing policy"})
    eviction_policy: str = field(default="unicache", metadata={"help": "KV-cache eviction policy of the replicas"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int = field(
        default=0, metadata={"help": "KV blocks per replica (0: 2048; with --engine vllm: vLLM's memory profiling sizes the pool on a GPU, 1024 on CPU)"}
    )
    host_blocks: int = field(default=0, metadata={"help": "host-memory KV tier blocks per replica (0: none; torch engine)"})
    host_eviction_policy: str = field(default="unicache", metadata={"help": "the host tier's eviction policy"})
    engine: str = field(default="torch", metadata={"help": "replica engine: torch (built-in) or vllm (needs --model)"})
    checkpoint: str = field(
        default="", metadata={"help": "local Hugging Face model dir, also --model (empty: small seeded model, torch engine)"}
    )
    served_model_name: str = field(default="", metadata={"help": "model name clients use (default: the model dir's name)"})
    max_model_len: int = field(default=0, metadata={"help": "longest prompt + output per replica (0: the model's context)"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "--engine vllm: GPUs per replica (tensor parallelism)"})
    gpu_memory_utilization: float = field(
        default=0.0, metadata={"help": "--engine vllm on GPUs: share of each GPU vLLM may use (0: vLLM's default)"}
    )
    enforce_eager: bool = field(default=False, metadata={"help": "--engine vllm on GPUs: no CUDA graphs"})
    vllm_args: str = field(
        default="", metadata={"help": "--engine vllm: other vLLM engine arguments, a JSON object (a mapping in a config file)"}
    )
    tokenizer: str = field(default="", metadata={"help": "tokenizer.json (empty: byte-level)"})
    api_keys: str = field(default="", metadata={"help": "'key:tenant,...'; empty: local mode, no auth (secret: prefer the env)"})
    salt_secret: str = field(default="", metadata={"help": "tenant salt secret (empty: random per run; secret: prefer the env)"})
    redis_password: str = field(default="", metadata={"help": "password of an external --redis-url (secret)"})
    redis_password_file: str = field(default="", metadata={"help": "file holding the external Redis password"})
    redis_tls_ca: str = field(default="", metadata={"help": "CA bundle verifying an external rediss:// Redis"})
    ready_timeout_s: float = field(default=300.0, metadata={"help": "deadline for everything to come up"})


SECRETS = frozenset({"api_keys", "salt_secret", "redis_password"})


def served_model_name(cfg: ClusterSettings) -> str:
    """The name the router serves: --served-model-name, else the model directory's name,
    else empty (the router's own default for the seeded model)."""
    if cfg.served_model_name:
        return cfg.served_model_name
    return os.path.basename(os.path.normpath(cfg.checkpoint)) if cfg.checkpoint else ""


@dataclass(slots=True)
class Endpoints:
    grpc: str
    http: str
    redis_url: str
    replicas: list[tuple[str, str, str, str]]  # (id, address, device, metrics URL)


def replica_settings(cfg: ClusterSettings, redis_url: str, redis_password_file: str = "", cluster_key_file: str = "",
                     tls: tuple[str, str, str] = ("", "", "")):
    """The settings every replica of the run starts with (secrets by file, never by value;
    ``tls``: the (CA, certificate, key) paths, ``{replica_id}`` standing for the id)."""
    from unicache.replica.settings import ReplicaSettings

    return ReplicaSettings(
        tls_ca=tls[0],
        tls_cert=tls[1],
        tls_key=tls[2],
        redis_url=redis_url,
        redis_prefix=cfg.redis_prefix,
        redis_password_file=redis_password_file,
        redis_tls_ca=cfg.redis_tls_ca,
        cluster_key_file=cluster_key_file,
        eviction_policy=cfg.eviction_policy,
        block_size=cfg.block_size,
        num_blocks=cfg.num_blocks or (0 if cfg.engine == "vllm" else DEFAULT_NUM_BLOCKS),
        host_blocks=cfg.host_blocks,
        host_eviction_policy=cfg.host_eviction_policy,
        checkpoint=cfg.checkpoint,
        tokenizer=cfg.tokenizer,
        engine=cfg.engine,
        served_model_name=cfg.served_model_name,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        vllm_args=cfg.vllm_args,
    )


def check_settings(cfg: ClusterSettings) -> None:
    """Refuse every setting a later step would refuse, before Redis, Ray or a replica
    starts (an unknown policy used to surface after 30-40 s, behind Ray's tracebacks).
    Raises ``UsageError`` naming the setting and, for a policy, the valid names."""
    from unicache.router.config import check_routing_policy

    if cfg.num_replicas < 1:
        raise UsageError("--replicas must be at least 1")
    for name in ("grpc_port", "http_port"):
        if not 0 <= getattr(cfg, name) <= 65535:
            raise UsageError(f"{name} must be 0-65535, got {getattr(cfg, name)}")
    if cfg.ready_timeout_s <= 0:
        raise UsageError("ready_timeout_s must be positive")
    check_routing_policy(cfg.routing_policy)
    replica_settings(cfg, cfg.redis_url).check()


@contextlib.contextmanager
def terminal_interrupt_deferred():
    """Block SIGINT in this thread while the block runs: processes started inside (redis-server,
    Ray's GCS and raylet, and through the raylet the replica workers) inherit the blocked
    mask, so a terminal's Ctrl-C, which reaches the whole foreground process group, reaches
    only ``unicache up``, which then stops them in order. A Ctrl-C pressed inside the block
    is delivered when it ends.

    NOTE: without it Ctrl-C killed Redis and Ray under the running router and replicas:
    a Redis traceback on the way out, or a segfault of Ray's driver during start-up.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class LocalCluster:
    """Owns every process and temp dir of a local run. ``start`` then ``stop`` (idempotent)."""

    def __init__(self, cfg: ClusterSettings):
        if cfg.num_replicas < 1:
            raise UsageError("--replicas must be at least 1")
        self.cfg = cfg
        # NOTE: what already ran below this process is not the run's to end at stop
        self._preexisting = frozenset(descendants(os.getpid()))
        self.redis = None
        self.launcher = None
        self.router = None
        self._ray_started = False
        self._tmp = tempfile.mkdtemp(prefix="unicache-")
        self._extra_tmp: str | None = None
        self.redis_url = cfg.redis_url
        self.redis_password = settings_mod.resolve_secret(cfg.redis_password, cfg.redis_password_file, "redis_password")
        self.redis_password_file = cfg.redis_password_file
        self.cluster_key = new_cluster_key()
        self.cluster_key_file = write_private(os.path.join(self._tmp, "cluster.key"), self.cluster_key)
        # NOTE: mutual TLS between router and replicas: an ephemeral CA whose key is never
        # written, and its certificates in the private run dir (0700, files 0600), removed
        # with it at stop.
        self.router_tls, self.replica_tls = make_cluster_pki(self._tmp, [f"replica-{i}" for i in range(cfg.num_replicas)])

    # ------------------------------------------------------------------ start
    def _ray_temp_dir(self) -> str:
        # NOTE: Ray puts unix sockets under its temp dir and AF_UNIX paths are capped at
        # 107 bytes, so a long $TMPDIR gets a short sibling under /tmp instead.
        if len(self._tmp) <= 40:
            return os.path.join(self._tmp, "ray")
        self._extra_tmp = tempfile.mkdtemp(prefix="uc-ray-", dir="/tmp")
        return self._extra_tmp

    def start_backends(self) -> list[tuple[str, str, str, str]]:
        """Redis, Ray and the replicas (synchronous; call before the event loop runs)."""
        from unicache.replica.engines.builtin.cpu_env import prefer_passive_omp_wait

        prefer_passive_omp_wait()
        import ray

        from unicache.replica.launcher import ReplicaLauncher
        from unicache.plumbing.redis_server import EmbeddedRedis

        cfg = self.cfg
        if not self.redis_url:
            self.redis = EmbeddedRedis(password=secrets.token_urlsafe(24))
            with terminal_interrupt_deferred():
                self.redis.start()
            self.redis_url = self.redis.plain_url
            self.redis_password = self.redis.password
            self.redis_password_file = self.redis.write_password_file(os.path.join(self._tmp, "redis.password"))
            log.info("started redis-server on %s (password in %s)", self.redis_url, self.redis_password_file)
        elif self.redis_password and not self.redis_password_file:
            self.redis_password_file = write_private(os.path.join(self._tmp, "redis.password"), self.redis_password)
        # NOTE: silences Ray's FutureWarning about CUDA_VISIBLE_DEVICES on CPU-only actors.
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        # NOTE: no dashboard, so no metrics agent: without this every Ray process logs that
        # it cannot reach one. The replicas serve their own /metrics.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")

        with terminal_interrupt_deferred():
            self._init_ray(ray)
            # NOTE: inside the block: a held Ctrl-C is raised as it ends, and stop_backends
            # must then know Ray runs.
            self._ray_started = True
        base = replica_settings(cfg, self.redis_url, self.redis_password_file, self.cluster_key_file, self.replica_tls)
        self.launcher = ReplicaLauncher(base, cfg.num_replicas, start_timeout_s=cfg.ready_timeout_s)
        return [(r.replica_id, r.address, r.device, r.metrics_url) for r in self.launcher.start()]

    def _init_ray(self, ray) -> None:
        cfg = self.cfg
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",  # NOTE: keep Ray's own sockets on loopback
            num_cpus=max(os.cpu_count() or 1, cfg.num_replicas),
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            _temp_dir=self._ray_temp_dir(),
        )

    def router_config(self):
        """The router's settings for this cluster (its served model name included)."""
        from unicache.router.config import RouterConfig

        cfg = self.cfg
        return RouterConfig(
            grpc_host=cfg.host,
            grpc_port=cfg.grpc_port,
            http_host=cfg.host,
            http_port=cfg.http_port,
            redis_url=self.redis_url,
            redis_prefix=cfg.redis_prefix,
            redis_password=self.redis_password,
            redis_tls_ca=cfg.redis_tls_ca,
            cluster_key=self.cluster_key,
            replica_tls_ca=self.router_tls.ca,
            replica_tls_cert=self.router_tls.cert,
            replica_tls_key=self.router_tls.key,
            routing_policy=cfg.routing_policy,
            auth_enabled=bool(cfg.api_keys),
            api_keys=cfg.api_keys,
            salt_secret=cfg.salt_secret or secrets.token_hex(16),
            block_size=cfg.block_size,
            tokenizer=cfg.tokenizer,
            checkpoint=cfg.checkpoint,
            **({"served_model_name": name} if (name := served_model_name(cfg)) else {}),
        )

    async def start_router(self) -> tuple[str, str]:
        from unicache.router.app import RouterApp

        self.router = RouterApp(self.router_config())
        await self.router.start()
        cfg = self.cfg
        return f"{cfg.host}:{self.router.grpc_port}", f"http://{cfg.host}:{self.router.http_port}"

    async def wait_ready(self, grpc_addr: str, want_replicas: int) -> None:
        """Until the router answers gRPC health and has seen every replica's heartbeat."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self.cfg.ready_timeout_s
        async with grpc.aio.insecure_channel(grpc_addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    seen = len(self.router.cluster.replicas)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING and seen >= want_replicas:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise UsageError(f"router not ready within {self.cfg.ready_timeout_s:.0f}s")
                await asyncio.sleep(0.1)

    # ------------------------------------------------------------------- stop
    async def stop_router(self) -> None:
        if self.router is not None:
            await self.router.stop()
            self.router = None

    def stop_backends(self) -> None:
        """Replicas, then Ray, then Redis, then the temp dir; then whatever process this run
        started is still alive is ended (an engine core orphaned when its replica actor was
        killed mid-shutdown, a Ray worker started during the stop: see
        unicache/plumbing/process_tree.py). Safe to call twice."""
        started = [p for p in descendants(os.getpid()) if p not in self._preexisting]
        try:
            self._stop_backends()
        finally:
            left = reap_below(os.getpid(), self._preexisting, started)
            if left:
                log.warning("ended %d process(es) a clean stop left behind: %s", len(left), ", ".join(str(p.pid) for p in left))

    def _stop_backends(self) -> None:
        if self.launcher is not None:
            try:
                self.launcher.stop()
            finally:
                self.launcher = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False
        if self.redis is not None:
            self.redis.close()
            self.redis = None
        for path in (self._tmp, self._extra_tmp):
            if path:
                shutil.rmtree(path, ignore_errors=True)


# NOTE: longer than two 16-token blocks, so its second sending is served from the cache
# (a prompt shorter than one block never hits: only whole blocks are cached).
HELLO_PROMPT = "Hello, cache! Send me twice: the second time my blocks are already in the KV cache."


def print_ready(ep: Endpoints, api_key: str | None, model: str = "unicache-default") -> None:
    from unicache.router.config import mask_url_password

    # NOTE: the banner is often captured into logs, so it shows a placeholder, never a key.
    auth = ' -H "Authorization: Bearer $API_KEY"' if api_key else ""
    meta = ", metadata=[('authorization', 'Bearer ' + os.environ['API_KEY'])]" if api_key else ""
    host, _, port = ep.grpc.rpartition(":")
    router_flag = "" if ep.grpc == LOCAL_ROUTER else f" --router {ep.grpc}"  # status/demo default to LOCAL_ROUTER
    lines = [
        f"ready grpc={ep.grpc} http={ep.http} replicas={len(ep.replicas)}",
        f"  router gRPC     {ep.grpc}   (unicache.v1.Router, health, reflection)",
        f"  OpenAI HTTP     {ep.http}/v1/completions, {ep.http}/v1/chat/completions",
        f"  dashboard       {ep.http}/dashboard     metrics {ep.http}/metrics",
        f"  redis           {mask_url_password(ep.redis_url)}",
    ]
    for rid, addr, device, metrics_url in ep.replicas:
        lines.append(f"  replica {rid:10s} {addr} ({device})" + (f"   metrics {metrics_url}" if metrics_url else ""))
    lines += [
        "",
        "Try:" + ("   (export API_KEY=<one of the --api-keys keys>)" if api_key else ""),
        f"  curl -s {ep.http}/v1/completions -H 'Content-Type: application/json'{auth} \\",
        f"""    -d '{{"model": "{model}", "prompt": "{HELLO_PROMPT}", "max_tokens": 8}}'""",
        "    (run it twice: the second reply's usage.prompt_tokens_details.cached_tokens counts the tokens served from cache)",
        f"  unicache status{router_flag}",
        f"  unicache demo{router_flag}",
        "  python -c \"import os, grpc; from unicache.v1 import router_pb2 as pb, router_pb2_grpc as g; "
        f"s = g.RouterStub(grpc.insecure_channel('{host}:{port}')); "
        f"print([r.text for r in s.Generate(pb.RouterGenerateRequest(text='Hello', sampling={{'max_tokens': 8}}){meta})])\"",
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def run_up(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = settings_mod.build(ClusterSettings, args, secrets=SECRETS)
    check_settings(cfg)
    # NOTE: every orphan below the leader becomes its child, so the stop finds it (one
    # started during the stop and orphaned, a Ray worker say, would go to init otherwise).
    become_subreaper()
    cluster = LocalCluster(cfg)
    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        # SIGTERM while backends start interrupts the start like Ctrl-C; cleanup follows.
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            replicas = cluster.start_backends()
        except KeyboardInterrupt:
            return 0
        api_key = cfg.api_keys.split(",")[0].split(":")[0] if cfg.api_keys else None

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            stopped = asyncio.Event()
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(s, stopped.set)
            try:
                grpc_addr, http_url = await cluster.start_router()
                ready = asyncio.create_task(cluster.wait_ready(grpc_addr, len(replicas)))
                waiter = asyncio.create_task(stopped.wait())
                done, _ = await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if ready in done:
                    ready.result()
                    print_ready(Endpoints(grpc_addr, http_url, cluster.redis_url, replicas), api_key,
                                served_model_name(cfg) or "unicache-default")
                    await stopped.wait()
                else:
                    ready.cancel()
                waiter.cancel()
            finally:
                for s in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(s)
                await cluster.stop_router()

        asyncio.run(serve())
        print("stopping", flush=True)
        return 0
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        cluster.stop_backends()
        for s, h in old.items():
            signal.signal(s, h)
        sys.stdout.flush()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a local cluster: Redis, Ray, replicas and the router",
        description=(
            "Start everything on this machine with nothing configured. Every setting is a flag, "
            "an environment variable UNICACHE_<NAME>, or a key in the --config file (YAML/JSON)."
        ),
    )
    settings_mod.add_arguments(p, ClusterSettings, secrets=SECRETS, aliases={"num_replicas": ["--replicas"], "checkpoint": ["--model"]})
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_up)
