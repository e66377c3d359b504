"""The paged KV cache: per attention layer one K and one V tensor of
``[num_blocks, block_size, kv_heads, head_dim]``, attached to the layer, and the copy-on-write
block copies a step makes before its forward."""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.device_copy import to_device


class KVCache:
    def __init__(self, attention_layers: list, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = attention_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0

    def block_bytes(self) -> int:
        """Bytes of one block over every layer, K and V."""
        attn = self.layers[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_token * self.block_size * len(self.layers)

    def allocate(self, num_blocks: int, separate: bool = True) -> None:
        """Give every layer a zeroed cache of ``num_blocks`` blocks: separate K and V tensors
        (the real cache), or one tensor serving as both (a throwaway for start-up's steps,
        which store nothing)."""
        attn = self.layers[0]
        shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        for layer in self.layers:
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = (torch.zeros(shape, dtype=self.dtype, device=self.device)
                             if separate else layer.k_cache)
        self.num_blocks = num_blocks

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies in the order made. A block that one copy reads may have been
        freed (preemption) and become a later copy's destination: such reads go first, so no
        launch has a block both as a source and a destination."""
        destinations = {d for _, d in copies}
        first = [c for c in copies if c[0] in destinations]
        for wave in (first, [c for c in copies if c[0] not in destinations]):
            if wave:
                src, dst = (to_device(list(x), self.device) for x in zip(*wave))
                for layer in self.layers:
                    kernels.copy_blocks(layer.k_cache, layer.v_cache, src, dst)

    def close(self) -> None:
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.num_blocks = 0
