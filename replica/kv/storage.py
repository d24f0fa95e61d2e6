"""Where block contents live. The store calls ``copy_block`` for copy-on-write and, with a
host tier whose transfers it records, ``run_transfers`` (``unicache.replica.kv.transfers``).

``MetadataOnlyStorage`` keeps no tensors (the simulator and the router's tests);
``unicache.replica.kv.torch_storage.TorchKVStorage`` holds real K/V tensors. Keeping the torch
import in its own module lets the store import without torch.
"""

from __future__ import annotations

from typing import Protocol


class KVStorage(Protocol):
    num_blocks: int

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s contents into block ``dst`` (copy-on-write)."""


class MetadataOnlyStorage:
    """No tensors: the store's bookkeeping alone. Counts copies so tests can see COW."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.copies: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
