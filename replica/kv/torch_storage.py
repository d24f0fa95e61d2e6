"""K/V tensors for the paged KV store, allocated once on the engine's device.

Layout: ``k`` and ``v`` are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; ``layer_views(layer)`` gives the
layer's cache flattened to ``[num_blocks * block_size, num_kv_heads, head_dim]`` so the
attention kernel can scatter/gather by slot.

With ``host_blocks`` > 0 it also holds the host tier's tensors, ``host_k`` / ``host_v``
``[num_layers, host_blocks, block_size, num_kv_heads, head_dim]`` in CPU memory (pinned when
the pool is on CUDA, so copies can use DMA). Only ``run_transfers`` touches them: the
forward pass reads the pool alone.

Invariant: the tensors are never reallocated (views handed out stay valid).
"""

from __future__ import annotations

import torch

from unicache.contract.kv_tier import Tier
from unicache.replica.kv.transfers import TransferRun


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
        host_blocks: int = 0,
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
        self.device = self.k.device
        self.host_blocks = host_blocks
        self.host_k = self.host_v = None
        if host_blocks > 0:
            host_shape = (num_layers, host_blocks, block_size, num_kv_heads, head_dim)
            pin = self.device.type == "cuda"
            self.host_k = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
            self.host_v = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches as ``[slots, kv_heads, head_dim]`` views."""
        return self._k_flat[layer], self._v_flat[layer]

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def run_transfers(self, runs: list[TransferRun]) -> None:
        """Each run as one gather and one scatter per tensor, in order (``transfer_runs``).

        A demotion run's device-to-host copy is synchronous (the source block may be
        overwritten by the next prefill); a promotion run's copy goes on the pool's stream
        ahead of the forward pass that reads it."""
        assert self.host_k is not None and self.host_v is not None, "no host tier"
        for run in runs:
            if run.tier is Tier.HOST:
                src = torch.tensor(run.src, dtype=torch.long, device=self.device)
                dst = torch.tensor(run.dst, dtype=torch.long)
                self.host_k.index_copy_(1, dst, self.k.index_select(1, src).cpu())
                self.host_v.index_copy_(1, dst, self.v.index_select(1, src).cpu())
            else:
                src = torch.tensor(run.src, dtype=torch.long)
                dst = torch.tensor(run.dst, dtype=torch.long, device=self.device)
                pin = self.device.type == "cuda"
                k, v = self.host_k.index_select(1, src), self.host_v.index_select(1, src)
                if pin:
                    k, v = k.pin_memory(), v.pin_memory()
                self.k.index_copy_(1, dst, k.to(self.device, non_blocking=pin))
                self.v.index_copy_(1, dst, v.to(self.device, non_blocking=pin))
