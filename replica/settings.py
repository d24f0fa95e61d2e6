"""Replica settings: one dataclass, every field a CLI flag and an environment variable.

Field ``foo_bar`` is flag ``--foo-bar``, variable ``UNICACHE_FOO_BAR`` and key ``foo_bar`` of
the ``--config`` file; precedence is flag, then variable, then file, then the default below. The same object configures ``unicache
replica`` (one process), the Ray actor and the launcher, so the three cannot drift.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass, field

from unicache.contract.model_name import served_model_name
from unicache.contract.redis_keys import DEFAULT_PREFIX
from unicache.contract.state_auth import parse_cluster_key
from unicache.plumbing import settings
from unicache.plumbing.errors import UsageError
from unicache.plumbing.settings import env_name  # noqa: F401 - re-exported for replica/cli.py
from unicache.replica.engines.builtin.config import EngineConfig

DEFAULT_NUM_BLOCKS = 1024
"""KV blocks when ``num_blocks`` is 0 (but the vllm engine on CUDA: vLLM sizes its pool)."""
from unicache.replica.engines.builtin.model_config import model_preset
from unicache.replica.eviction.registry import EVICTION_POLICIES
from unicache.replica.serving.faults import FaultInjection


def _help(text: str) -> dict:
    return {"help": text}


def replica_eviction_policies() -> list[str]:
    """The registered eviction policies a replica can run: those built from no arguments
    (``opt`` needs the trace's future, so it runs only in the simulator). The Helm
    schema's ``replicas.evictionPolicy`` enum is this list (a test keeps it so)."""
    names = []
    for name in EVICTION_POLICIES.names():
        try:
            EVICTION_POLICIES.make(name)
        except TypeError:
            continue
        names.append(name)
    return names


def _eviction_policy_help() -> str:
    """``--eviction-policy``'s help, from the eviction registry (never a hand-kept list)."""
    runs = replica_eviction_policies()
    sim_only = [name for name in EVICTION_POLICIES.names() if name not in runs]
    text = f"KV-cache eviction policy: {', '.join(runs)}"
    if sim_only:
        text += f" ({', '.join(sim_only)}: simulator only)"
    return text + "; with --engine vllm also 'vllm': vLLM's own"


@dataclass(slots=True)
class ReplicaSettings:
    replica_id: str = field(default="replica-0", metadata=_help("stable replica id (survives restarts)"))
    host: str = field(default="127.0.0.1", metadata=_help("interface the gRPC server binds (0.0.0.0 in a pod)"))
    port: int = field(default=0, metadata=_help("gRPC port; 0 picks a free one"))
    hop_port: int = field(
        default=0,
        metadata=_help("framed hop port (Generate for routers, cheaper than gRPC; same interface as gRPC); 0 picks a free one, -1 serves none"),
    )
    metrics_port: int = field(
        default=0, metadata=_help("Prometheus /metrics port (same interface as gRPC); 0 picks a free one, -1 serves none")
    )
    metrics_port_span: int = field(
        default=1,
        metadata=_help("ports tried from metrics_port on, the first free one bound (replicas sharing a host or pod: one each)"),
    )
    advertise_host: str = field(
        default="", metadata=_help("host routers dial (default: host, or $POD_IP / this host's IP when host is 0.0.0.0)")
    )
    redis_url: str = field(default="", metadata=_help("Redis for cache events and heartbeats; empty: publish nothing"))
    redis_prefix: str = field(default=DEFAULT_PREFIX, metadata=_help("namespace of every Redis key"))
    redis_password: str = field(default="", repr=False, metadata=_help("Redis password if not in redis_url (secret)"))
    redis_password_file: str = field(default="", metadata=_help("file holding the Redis password (instead of redis_password)"))
    cluster_key: str = field(
        default="", repr=False,
        metadata=_help("cluster key (secret, >= 16 bytes; hex): signs what the replica writes to Redis, and every router call must prove it; required with redis_url"),
    )
    cluster_key_file: str = field(default="", metadata=_help("file holding the cluster key (instead of cluster_key)"))
    redis_tls_ca: str = field(default="", metadata=_help("CA bundle verifying the server of a rediss:// redis_url"))
    tls_ca: str = field(default="", metadata=_help("mutual TLS with routers: the cluster CA bundle (routers' client certificates must chain to it)"))
    tls_cert: str = field(
        default="",
        metadata=_help("mutual TLS: this replica's certificate, naming its replica id (unicache.plumbing.tls); '{replica_id}' in the path "
                       "stands for the id (replicas launched from one template); rotated files are picked up"),
    )
    tls_key: str = field(default="", metadata=_help("mutual TLS: the private key of tls_cert (secret file; '{replica_id}' as there)"))
    insecure_no_tls: bool = field(
        default=False,
        metadata=_help("INSECURE opt-out: with a cluster key, serve routers without mutual TLS (a relay reads requests in clear, "
                       "a router's credential captured by a squatter opens this replica; docs/security.md); logged at every start, "
                       "unicache_replica_insecure_transport 1"),
    )
    engine: str = field(default="torch", metadata=_help("serving engine: torch (built-in) or vllm (vLLM V1 in-process, extra [vllm])"))
    eviction_policy: str = field(
        default="unicache",
        metadata=_help(_eviction_policy_help()),
    )
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    num_blocks: int = field(
        default=0,
        metadata=_help(f"KV blocks in the cache; 0: {DEFAULT_NUM_BLOCKS}, except the vllm engine on CUDA, whose pool "
                       "vLLM sizes from its memory profiling (gpu_memory_utilization)"),
    )
    host_blocks: int = field(
        default=0,
        metadata=_help("KV blocks of a host-memory tier under the cache (0: none; torch engine only): victims are "
                       "demoted to it, prefix matches promote them back"),
    )
    host_eviction_policy: str = field(
        default="unicache", metadata=_help("the host tier's eviction policy (unicache: the GPU UniCache's demotion order per class queue; lru: vLLM's/LMCache's)")
    )
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda or cuda:N"))
    dtype: str = field(default="auto", metadata=_help("auto, float32, bfloat16, float16"))
    checkpoint: str = field(
        default="",
        metadata=_help("local Hugging Face model dir, also --model (empty: seeded random model; required with --engine vllm)"),
    )
    served_model_name: str = field(default="", metadata=_help("model name clients use (default: the model directory's name)"))
    tokenizer: str = field(default="", metadata=_help("tokenizer.json path (empty: byte-level)"))
    max_num_seqs: int = field(default=64, metadata=_help("most sequences running at once"))
    max_model_len: int = field(default=0, metadata=_help("longest prompt + output (0: the model's context)"))
    gpu_memory_utilization: float = field(
        default=0.0, metadata=_help("vllm engine on CUDA: share of each GPU vLLM may use (0: vLLM's default)")
    )
    tensor_parallel_size: int = field(
        default=1, metadata=_help("vllm engine: GPUs one replica spans (tensor parallelism); the Ray actor requests as many")
    )
    enforce_eager: bool = field(default=False, metadata=_help("vllm engine on CUDA: no CUDA graphs (faster start, slower decode)"))
    vllm_args: str = field(
        default="",
        metadata=_help("vllm engine: other vLLM engine arguments, a JSON object (a mapping in a config file), e.g. "
                       "'{\"kv_cache_dtype\": \"fp8\"}'; keys are vLLM's EngineArgs, checked at start"),
    )
    max_num_batched_tokens: int = field(default=2048, metadata=_help("most tokens computed per engine step"))
    max_waiting: int = field(
        default=1024, metadata=_help("most requests waiting to start; more get RESOURCE_EXHAUSTED at once (load shedding)")
    )
    seed: int = field(default=0, metadata=_help("seed of the random weights and default sampler"))
    default_max_tokens: int = field(default=16, metadata=_help("max_tokens when a request gives 0"))
    model_preset: str = field(
        default="default", metadata=_help("architecture of the seeded random model: default, or tiny (fast tests)")
    )
    fault_first_token_delay_s: float = field(
        default=0.0, metadata=_help("fault injection (tests): delay every request this long before it starts")
    )
    fault_token_delay_s: float = field(
        default=0.0, metadata=_help("fault injection (tests): delay each streamed message after the first")
    )

    def check(self, local_paths: bool = True) -> None:
        """Refuse now what the engine would refuse only once Ray and the actors are up: an
        unknown eviction policy (naming the valid ones), a size that is not positive, an
        unknown engine, a vllm engine without a model directory, and (``local_paths``: the
        engine runs on this machine) a checkpoint or tokenizer that is not there. A launcher
        (``unicache replicas``) passes ``local_paths=False``: the paths are the worker
        pods'. Raises ``UsageError``."""
        from unicache.replica.engines.registry import ENGINES

        if self.engine not in ENGINES:
            raise UsageError(f"engine: unknown engine {self.engine!r} (choose from {', '.join(ENGINES)})")
        if self.host_blocks < 0:
            raise UsageError(f"host_blocks must be >= 0, got {self.host_blocks}")
        if self.engine == "vllm":
            if self.host_blocks:
                raise UsageError("host_blocks: the vllm engine has no host tier (vLLM 0.32.0's CPU offloading keeps "
                                 "its own copy policy and needs CUDA; see docs/host_tier.md); use --engine torch "
                                 "or --host-blocks 0")
            try:
                self.vllm_engine_config()
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        else:
            for flag, name in (("eviction_policy", self.eviction_policy), ("host_eviction_policy", self.host_eviction_policy)):
                if flag == "host_eviction_policy" and not self.host_blocks:
                    continue
                try:
                    EVICTION_POLICIES.get(name)
                except ValueError as exc:
                    raise UsageError(f"{flag}: {exc}") from None
                if name not in replica_eviction_policies():
                    raise UsageError(f"{flag}: {name!r} needs the future (simulator only); "
                                     f"a replica runs one of {', '.join(replica_eviction_policies())}")
        if any((self.tls_ca, self.tls_cert, self.tls_key)) and not all((self.tls_ca, self.tls_cert, self.tls_key)):
            raise UsageError("mutual TLS needs all of tls_ca, tls_cert and tls_key")
        self.check_transport(warn=False)
        if self.hop_port < -1 or self.hop_port > 65535:
            raise UsageError(f"hop_port must be -1 (none), 0 (a free port) or a port number, got {self.hop_port}")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise UsageError(f"metrics_port must be -1 (none), 0 (a free port) or a port number, got {self.metrics_port}")
        if self.metrics_port_span < 1 or self.metrics_port + self.metrics_port_span - 1 > 65535:
            raise UsageError(f"metrics_port_span must be >= 1 and end at a port number, got {self.metrics_port_span}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")  # 0 stands for the default
        if self.engine != "vllm" and (self.tensor_parallel_size > 1 or self.vllm_args):
            raise UsageError("tensor_parallel_size and vllm_args need the vllm engine (--engine vllm)")
        if not local_paths:
            return
        if self.checkpoint and not os.path.isdir(self.checkpoint):
            raise UsageError(f"checkpoint {self.checkpoint} is not a directory")
        if self.tokenizer and self.tokenizer != "byte" and not os.path.isfile(self.tokenizer):
            raise UsageError(f"tokenizer {self.tokenizer} is not a file")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=model_preset(self.model_preset),
            checkpoint=self.checkpoint or None,
            tokenizer=self.tokenizer or None,
            num_blocks=self.num_blocks or DEFAULT_NUM_BLOCKS,
            block_size=self.block_size,
            eviction_policy=self.eviction_policy,
            device=self.device,
            max_model_len=self.max_model_len or None,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_waiting=self.max_waiting,
            seed=self.seed,
            host_blocks=self.host_blocks,
            host_eviction_policy=self.host_eviction_policy,
        )

    def vllm_engine_values(self) -> dict:
        """``VLLMEngineConfig`` keyword arguments from these settings (``vllm_args`` parsed)."""
        return dict(
            model=self.checkpoint,
            served_model_name=self.served_model_name,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            eviction_policy=self.eviction_policy,
            device=self.device,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or None,
            max_waiting=self.max_waiting,
            seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization or None,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager,
            vllm_args=parse_vllm_args(self.vllm_args),
        )

    def vllm_engine_config(self):
        """The vllm engine's ``VLLMEngineConfig`` (ValueError for a bad value)."""
        from unicache.replica.engines.vllm.config import VLLMEngineConfig

        return VLLMEngineConfig(**self.vllm_engine_values())

    def resolved_redis_password(self) -> str:
        return settings.resolve_secret(self.redis_password, self.redis_password_file, "redis_password")

    def tls_files(self) -> "TlsFiles | None":
        """This replica's TLS files (``unicache.plumbing.tls``), or None without TLS. UsageError if
        one cannot be read."""
        if not self.tls_cert:
            return None
        from unicache.plumbing.tls import TlsFiles

        rid = self.replica_id
        try:
            return TlsFiles(self.tls_ca, self.tls_cert.replace("{replica_id}", rid), self.tls_key.replace("{replica_id}", rid))
        except OSError as exc:
            raise UsageError(f"tls: cannot read {exc.filename}: {exc.strerror}") from None

    def check_transport(self, warn: bool = True) -> bool:
        """Whether this replica serves without mutual TLS by the explicit ``insecure_no_tls``
        opt-out (``warn``: log the warning, as every start does). UsageError naming the
        fix for a cluster key without tls_cert and without the opt-out
        (``unicache.plumbing.tls.insecure_transport``)."""
        from unicache.plumbing.tls import insecure_transport

        if not warn and self.insecure_no_tls and not self.tls_cert:
            return True
        return insecure_transport(
            component=f"replica {self.replica_id}", keyed=bool(self.cluster_key or self.cluster_key_file),
            has_tls=bool(self.tls_cert), insecure=self.insecure_no_tls, tls_settings="tls_ca, tls_cert and tls_key",
        )

    def resolved_cluster_key(self) -> bytes | None:
        """The cluster key as bytes, or None when none is set. UsageError if unreadable or short."""
        text = settings.resolve_secret(self.cluster_key, self.cluster_key_file, "cluster_key")
        if not text:
            return None
        try:
            return parse_cluster_key(text)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def model_name(self) -> str:
        """The served model name (the ``model_name`` label of the replica's metrics)."""
        return served_model_name(self.served_model_name, self.checkpoint)

    def faults(self) -> FaultInjection:
        return FaultInjection(self.fault_first_token_delay_s, self.fault_token_delay_s)

    def advertised_host(self) -> str:
        """The host part of the address published in the heartbeat."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


SECRET_FIELDS = frozenset({"redis_password", "cluster_key"})


FLAG_ALIASES = {"checkpoint": ["--model"]}


def parse_vllm_args(text: str) -> dict:
    """``vllm_args`` text -> the mapping (empty text: none). ValueError unless a JSON object."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"vllm_args must be a JSON object of vLLM engine arguments: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"vllm_args must be a JSON object of vLLM engine arguments, got {type(value).__name__}")
    return value


def add_settings_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add ``--config`` and ``--<field>`` for every ``ReplicaSettings`` field (unicache/plumbing/settings.py);
    ``--model`` is another name of ``--checkpoint``."""
    settings.add_arguments(parser, ReplicaSettings, skip=skip, secrets=SECRET_FIELDS, aliases=FLAG_ALIASES)


def settings_from_args(args: argparse.Namespace, **overrides) -> ReplicaSettings:
    """Flag, else ``UNICACHE_<NAME>``, else the config file, else the default; then
    ``overrides``. Callers run ``ReplicaSettings.check`` before they start anything."""
    return settings.build(ReplicaSettings, args, overrides=overrides, secrets=SECRET_FIELDS)
