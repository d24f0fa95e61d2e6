"""The one definition of a KV tier, shared by replica events, the wire format and the router.

``GPU`` is the engine's device pool (the pool the forward pass reads; CPU memory on a CPU
replica); ``HOST`` is the optional host-memory tier under it, whose blocks must be copied
back into the GPU pool (promoted) before a request can use them. The integer values are
the ``KVTier`` values of ``proto/unicache/v1`` (0 is the default, so a sender that never
sets the field means GPU).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from enum import IntEnum


class Tier(IntEnum):
    GPU = 0
    HOST = 1

    @property
    def label(self) -> str:
        """Lower-case name for tables, metrics labels and JSON (``gpu`` / ``host``)."""
        return self.name.lower()


def tier_run(block_hashes: Sequence, start: int, stop: int, host: Container, gpu: Container) -> tuple[int, list[int]]:
    """How many of ``block_hashes[start:stop]``, consecutively, the host tier or the GPU
    holds, and the positions among them that the GPU holds: the run a two-tier match
    continues through past a GPU prefix of ``start`` blocks (the replica's store matches
    it, the router's index predicts it from the replica's published holdings).

    The run's first block is in the host tier (a GPU block there would still be part of
    the prefix); past it a block may be in either. NOTE: a policy may evict a parent and
    keep its child (unicache's lanes do), so the chain on the GPU can resume after host
    blocks; a match that stopped at the first GPU block past the host ones would
    recompute a block the GPU holds and lose the rest of the chain. A run ending in GPU
    blocks keeps them: they are hits like the others.
    """
    n, on_gpu = 0, []
    for i in range(start, min(stop, len(block_hashes))):
        h = block_hashes[i]
        if h in host:
            n += 1
        elif n and h in gpu:
            on_gpu.append(i)
            n += 1
        else:
            break
    return n, on_gpu
