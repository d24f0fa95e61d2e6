"""Cache events: what a KV store (ours, or vLLM's through ``unicache.contract.vllm_events``) reports
entering and leaving its prefix cache; collected by the store, taken by a publisher or the
router's event follower (the store does no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.contract.kv_tier import Tier


@dataclass(slots=True, frozen=True)
class BlockStored:
    """A block entered the prefix cache in ``tier`` (a demotion is a GPU ``BlockRemoved``
    followed by a HOST ``BlockStored``; a promotion the reverse)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    timestamp: float
    tier: Tier = Tier.GPU


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """A block left the prefix cache's ``tier`` (evicted, cleared, demoted or promoted)."""

    block_hash: BlockHash
    timestamp: float
    tier: Tier = Tier.GPU


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache, both tiers, was dropped (reset); subscribers must forget this
    replica's blocks."""

    timestamp: float


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
