"""Rotary position embedding (rotate-half), applied in place to query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mul(a, b, dtype: tl.constexpr):
    return (a.to(tl.float32) * b.to(tl.float32)).to(dtype)


@triton.jit
def _rotate(ptr, token, s0, s1, num_heads, cos, sin, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = ptr + token * s0 + heads * s1 + dims
    x1 = tl.load(first, mask=mask)
    x2 = tl.load(first + HALF, mask=mask)
    # Each product and each sum is rounded to the input dtype, as the reference's tensor ops.
    dtype = ptr.dtype.element_ty
    out1 = _mul(x1, cos, dtype).to(tl.float32) - _mul(x2, sin, dtype).to(tl.float32)
    out2 = _mul(x2, cos, dtype).to(tl.float32) + _mul(x1, sin, dtype).to(tl.float32)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr,
    q_s0, q_s1, k_s0, k_s1, cache_s0, num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + position * cache_s0 + dims
    # The table is float32; the reference casts cos/sin to the input dtype first.
    cos = tl.load(row, mask=dims < HALF).to(q_ptr.dtype.element_ty)
    sin = tl.load(row + HALF, mask=dims < HALF).to(q_ptr.dtype.element_ty)
    _rotate(q_ptr, token, q_s0, q_s1, num_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    _rotate(k_ptr, token, k_s0, k_s1, num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)


def rope(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.rope``, in place on (possibly strided) ``[T, H, D]`` views;
    returns ``(query, key)``."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.dtype == key.dtype and cos_sin_cache.shape[1] == head_dim
    assert query.stride(-1) == key.stride(-1) == cos_sin_cache.stride(-1) == 1
    if num_tokens:
        half = head_dim // 2
        block_h = triton.next_power_of_2(num_heads)
        _rope_kernel[(num_tokens,)](
            query, key, positions, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            cos_sin_cache.stride(0), num_heads, num_kv_heads,
            HALF=half, BLOCK_H=block_h, BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4 if block_h * half >= 1024 else 1,
        )
    return query, key
