"""The engine's public surface: what the gRPC servicer (and tests) may use.

The servicer talks only to these types and to a ``ServingEngine`` (the built-in
``AsyncEngine`` of replica/engines/builtin/async_engine.py, or vLLM's in replica/engines/vllm/); it
never reaches into a scheduler, a model or a KV store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_events import KVEvent
from unicache.contract.request_class import RequestClass, SINGLE_TURN


class EngineInputError(ValueError):
    """The request cannot be served as given.

    ``kind`` is ``"invalid"`` (maps to INVALID_ARGUMENT / HTTP 400) or ``"exhausted"``
    (RESOURCE_EXHAUSTED). An exhausted request with ``overloaded`` set was refused because
    the replica is busy (retry later: HTTP 429); without it, it can never fit (prompt
    beyond the context or the whole cache: HTTP 413).
    """

    def __init__(self, kind: str, message: str, overloaded: bool = False):
        assert kind in ("invalid", "exhausted")
        self.kind = kind
        self.overloaded = overloaded
        super().__init__(message)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens; field names and meanings follow vLLM's ``SamplingParams``.

    ``max_tokens`` None generates up to the context. ``logprobs`` None returns none; k
    returns the chosen token's logprob plus the k most likely (log-softmax of the raw
    logits, before penalties and temperature, as vLLM's default ``raw_logprobs``).
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI: a token generated c times
    so far in this sample gets ``logit -= c * frequency_penalty + (c > 0) * presence_penalty``
    (prompt tokens do not count). A token in ``stop_token_ids`` finishes the sample with
    "stop"; its id is returned, its text is not.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False  # keep generating past the EOS token (benchmarks)
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cls: RequestClass = SINGLE_TURN
    cache_salt: bytes | None = None
    adapter_id: str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time_s: float = 0.0
    prefill_time_s: float = 0.0


@dataclass(slots=True)
class TokenLogprob:
    """A chosen token's logprob and the top ``(token_id, logprob)`` alternatives, highest first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineOutput:
    """One streamed step of one sample. ``finish_reason`` in {"length", "stop", "abort"}.

    ``logprobs``: one entry per ``new_token_ids`` entry when the request asked for them.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class EngineLoad:
    running: int
    waiting: int
    queued_prefill_tokens: int


@dataclass(slots=True)
class HostTierInfo:
    """The host tier's state (``CacheStateInfo.host``).

    ``hit_ratio`` is host-hit blocks over all prompt blocks queried (the GPU's
    ``CacheStateInfo.hit_ratio`` has the same denominator, so the two add up); every host
    hit is one promotion.
    """

    capacity_blocks: int
    used_blocks: int
    hit_ratio: float
    promotions: int
    demotions: int
    evictions: int
    eviction_policy: str

    @classmethod
    def of_store(cls, store, eviction_policy: str) -> "HostTierInfo | None":
        """From a ``KVStore`` (None without a host tier). The caller holds its lock."""
        host = store.host
        if host is None:
            return None
        q = store.stats.query_blocks
        return cls(host.num_blocks, host.num_used_blocks, host.stats.hit_blocks / q if q else 0.0,
                   host.stats.hit_blocks, host.stats.demotions, host.stats.evictions, eviction_policy)


@dataclass(slots=True)
class CacheStateInfo:
    """The GPU pool's state, and the host tier's (``host``) when the replica has one.
    ``queue_evictions`` / ``queue_hits`` are cumulative per eviction queue
    (``EvictionPolicy.queue_counters``); a policy that keeps no per-queue counts reports
    its total evictions under its own name and no hits."""

    block_size: int
    capacity_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    hit_ratio: float
    queue_sizes: dict[str, int]
    eviction_policy: str
    evictions: int
    host: HostTierInfo | None = None
    queue_evictions: dict[str, int] = field(default_factory=dict)
    queue_hits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_store(cls, store, eviction_policy: str, host_eviction_policy: str) -> "CacheStateInfo":
        """From a ``KVStore`` whose policies carry these names. The caller holds its lock."""
        counters = store.policy.queue_counters()
        return cls(
            block_size=store.block_size,
            capacity_blocks=store.num_blocks,
            used_blocks=store.num_used_blocks,
            free_blocks=store.num_free_blocks,
            cached_blocks=store.num_cached_blocks,
            hit_ratio=store.stats.hit_ratio,
            queue_sizes=store.policy.queue_sizes(),
            eviction_policy=eviction_policy,
            evictions=store.stats.evictions,
            host=HostTierInfo.of_store(store, host_eviction_policy),
            queue_evictions=counters.evictions if counters else {eviction_policy: store.stats.evictions},
            queue_hits=counters.hits if counters else {},
        )


@runtime_checkable
class ServingEngine(Protocol):
    """What the replica (gRPC servicer, publisher, heartbeats, Ray actor) drives.

    Two implementations: the built-in ``AsyncEngine`` (``engine="torch"``) and
    ``VLLMEngine`` (``engine="vllm"``, replica/engines/vllm/). Neither the servicer nor the
    publisher knows which one runs; replica/engines/registry.py builds one from the settings.

    Invariants every implementation keeps:
        * ``generate`` raises ``EngineInputError`` before yielding anything for a request it
          will not serve; closing its iterator early aborts the request and frees its blocks.
        * ``take_events`` returns the project's own cache events (``BlockStored`` /
          ``BlockRemoved`` / ``AllBlocksCleared``) keyed by the project's chained block
          hashes (unicache/contract/block_hash.py), each event exactly once; ``cached_hashes`` is
          the set those events describe.
        * ``cache_state``/``load`` never block and never raise once ``start`` returned.
    """

    device: Any
    block_size: int

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def load(self) -> EngineLoad: ...
    def cache_state(self) -> CacheStateInfo: ...
    def take_events(self) -> list[KVEvent]: ...
    def cached_hashes(self) -> list[BlockHash]: ...
    def host_hashes(self) -> list[BlockHash]:
        """Every hash the host-memory tier holds (empty without one)."""
        ...
    def cached_blocks(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """``cached_hashes`` with each block's parent hash (None: a first block), taken at
        once: what a summary publishes."""
        ...
