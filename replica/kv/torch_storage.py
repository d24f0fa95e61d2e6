"""K/V tensors for the paged KV store, allocated once on the engine's device.

Layout: ``k`` and ``v`` are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; ``layer_views(layer)`` gives the
layer's cache flattened to ``[num_blocks * block_size, num_kv_heads, head_dim]`` so the
attention kernel can scatter/gather by slot.

Invariant: the tensors are never reallocated (views handed out stay valid).
"""

from __future__ import annotations

import torch


class TorchKVStorage:
    """Real K/V tensors. ``copy_block`` implements the store's copy-on-write."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        flat = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self._k_flat = self.k.view(flat)
        self._v_flat = self.v.view(flat)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches as ``[slots, kv_heads, head_dim]`` views."""
        return self._k_flat[layer], self._v_flat[layer]

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
