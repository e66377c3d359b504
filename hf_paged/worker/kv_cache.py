"""The paged KV cache: per attention layer one K and one V tensor of
``[num_blocks, block_size, kv_heads, head_dim]``, attached to the layer, and the copy-on-write
block copies a step makes before its forward.

An FP8 cache (``kv_cache_dtype="fp8"``) holds float8_e4m3fn, one byte an element, so the same
memory holds twice the tokens of a bfloat16 one; each layer carries the float32 scales of its
keys and values per KV head, ``k_scale`` / ``v_scale`` ``[kv_heads]``, beside its caches: the
checkpoint's where it ships them, else calibrated at start-up (``worker.kv_scales``). They are
updated in place only, so the CUDA graphs that read them by address see them. With 16-bit
queries its attention computes in float16 (``kernels.attention``), so a 16-bit model whose
queries could leave float16's range is refused (``check_float16_queries``).
"""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.device_copy import to_device

FLOAT16_MAX = 65504.0


def check_float16_queries(attention_layers: list) -> None:
    """Raise unless every layer's queries stay within float16's range, where an FP8 cache's
    attention tiles hold 16-bit queries: a query head is RMS-normalised (``q_norm``), so each
    of its elements is at most ``sqrt(head_dim)`` times the norm weight's largest magnitude
    (RoPE rotates pairs of elements, which keeps that bound). A float32 model's attention
    stays in float32."""
    for i, layer in enumerate(attention_layers):
        norm = getattr(layer, "q_norm", None)
        if norm is not None and norm.weight.dtype == torch.float32:
            continue
        if norm is None:
            raise ValueError(f"kv_cache_dtype='fp8': attention layer {i} has no q_norm, so its "
                             "queries have no bound within float16's range")
        weight = norm.weight.detach().float() + (1.0 if norm.offset else 0.0)
        largest = float(weight.abs().max())
        if layer.head_dim**0.5 * largest > FLOAT16_MAX:
            raise ValueError(
                f"kv_cache_dtype='fp8': attention layer {i}'s q_norm.weight (largest magnitude "
                f"{largest:.4g}) lets a query element reach {layer.head_dim**0.5 * largest:.4g},"
                f" beyond float16's {FLOAT16_MAX:,.0f}, in which the FP8 cache's attention "
                "computes; use kv_cache_dtype='auto'")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an ``EngineConfig.kv_cache_dtype`` stores (``"auto"``: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


class KVCache:
    def __init__(self, attention_layers: list, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = attention_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        # Whether start-up calibrates the scales: an FP8 cache whose checkpoint shipped none.
        self.calibrates = False
        if dtype == torch.float8_e4m3fn:
            check_float16_queries(attention_layers)
            self.calibrates = any(layer.k_scale is None for layer in attention_layers)
            for layer in attention_layers:
                if self.calibrates or layer.k_scale is None:
                    layer.k_scale, layer.v_scale = (
                        torch.ones(layer.num_kv_heads, dtype=torch.float32, device=device)
                        for _ in "kv")

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
