"""Scatter this step's keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_s0, key_s1, value_s0, value_s1, cache_s0, cache_s1, cache_s2,
    num_kv_heads, head_dim,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding row of a graph batch
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache = (slot // PAGE) * cache_s0 + (slot % PAGE) * cache_s1 + heads * cache_s2 + dims
    key = tl.load(key_ptr + token * key_s0 + heads * key_s1 + dims, mask=mask)
    tl.store(k_cache_ptr + cache, key, mask=mask)
    value = tl.load(value_ptr + token * value_s0 + heads * value_s1 + dims, mask=mask)
    tl.store(v_cache_ptr + cache, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of ``reference.store_kv``; ``key``/``value`` may be strided views."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        PAGE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
