"""Cache events collected by the KV store and taken by a publisher (the store does no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from unicache.block_hash import BlockHash


@dataclass(slots=True, frozen=True)
class BlockStored:
    """A block entered the prefix cache."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    timestamp: float


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """A block left the prefix cache (evicted or cleared)."""

    block_hash: BlockHash
    timestamp: float


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset); subscribers must forget this replica's blocks."""

    timestamp: float


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
