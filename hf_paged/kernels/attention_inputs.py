"""Qwen3's attention inputs in one pass per token: per-head RMSNorm of q and k, RoPE on both
(in place), and k and v written into the paged cache (an FP8 cache: divided by their KV head's
scale, saturated, rounded to nearest even). Four kernels would each launch once per layer and
step; at small batches launches, not bytes, bound the step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch


@triton.jit
def _mul(a, b, dtype: tl.constexpr):
    """A product rounded to ``dtype``, as a tensor op in that dtype would."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(dtype)


@triton.jit
def _cache_value(x, scale, FP8: tl.constexpr):
    """``x`` as the cache stores it: ``reference.quantize_kv`` into an FP8 cache. The rounding
    to e4m3 (to nearest, ties to even) is float32 arithmetic, so the cast only converts an
    exact value: Triton's interpreter, which the CPU tests run, rounds float8 casts otherwise
    (up at ties, and 31.9 to 16 for want of a carry into the exponent)."""
    if FP8:
        # IEEE division, as torch's (``/`` on float32 is an approximate one on the GPU).
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
        # The step between e4m3 values around y: 3 bits below its leading one, and 2**-9 (the
        # subnormals') below 2**-6; as a biased float32 exponent, and its exact reciprocal.
        exponent = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6) - 3
        step = (exponent << 23).to(tl.float32, bitcast=True)
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
        # Adding and taking away 1.5 * 2**23 rounds |y| / step <= 16 to an integer, ties to
        # even; on the magnitude, with the sign put back after, so that a negative value
        # rounding to zero stays -0 (as torch's cast keeps it).
        rounded = ((tl.abs(y) * inverse + 12582912.0) - 12582912.0) * step
        y = tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)
        stored = y.to(tl.float8e4nv)
    else:  # one return after an if/else: the GPU compiler rejected an early return's other type
        stored = x
    return stored


@triton.jit
def _load_heads(ptr, token, s0, s1, num_heads,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's heads as their two halves: (address of the first, mask, first, second)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = ptr + token * s0 + heads * s1 + dims
    return (first, mask, tl.load(first, mask=mask, other=0.0),
            tl.load(first + HALF, mask=mask, other=0.0))


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, HALF: tl.constexpr):
    """Normalise and rotate loaded heads; every rounding point follows ``reference.rms_norm``
    then ``reference.rope``."""
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    # Normalised in float32, cast back, then scaled: transformers' Qwen3RMSNorm.
    n1 = _mul((x1 * inv_rms[:, None]).to(dtype), w1, dtype)
    n2 = _mul((x2 * inv_rms[:, None]).to(dtype), w2, dtype)
    out1 = (_mul(n1, cos, dtype).to(tl.float32) - _mul(n2, sin, dtype).to(tl.float32)).to(dtype)
    out2 = (_mul(n2, cos, dtype).to(tl.float32) + _mul(n1, sin, dtype).to(tl.float32)).to(dtype)
    return out1, out2


# The per-token indices may be views into a graph's packed inputs at any offset: their
# alignment is left out of the compiled variant (one variant for graphs and eager steps).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_ptr"])
def _norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cos_sin_s0, cache_s0, cache_s1, cache_s2,
    num_heads, num_kv_heads, eps,
    HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    # Every load is issued first: at small batches each dependent round trip to memory, not
    # the bytes, is what a step waits for. What no kernel of the step writes (the norms'
    # weights, the step's positions and slots, the rotary table) is read before waiting for
    # the previous kernel (``kernels.gdc``); q, k and v, its outputs, after.
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    half_ok = dims < HALF
    qw1 = tl.load(q_weight_ptr + dims, mask=half_ok, other=0.0)
    qw2 = tl.load(q_weight_ptr + HALF + dims, mask=half_ok, other=0.0)
    kw1 = tl.load(k_weight_ptr + dims, mask=half_ok, other=0.0)
    kw2 = tl.load(k_weight_ptr + HALF + dims, mask=half_ok, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    row = cos_sin_ptr + position * cos_sin_s0 + dims
    # The table is float32; the reference casts cos/sin to the input dtype first.
    cos = tl.load(row, mask=half_ok).to(q_ptr.dtype.element_ty)
    sin = tl.load(row + HALF, mask=half_ok).to(q_ptr.dtype.element_ty)
    heads = tl.arange(0, BLOCK_HKV)[:, None]
    k_scale = 1.0
    v_scale = 1.0
    if FP8:  # the scales are set at start-up, never by a kernel of the step
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
    wait_for_previous(PDL)
    q_first, q_mask, q1, q2 = _load_heads(q_ptr, token, q_s0, q_s1, num_heads,
                                          HALF, BLOCK_H, BLOCK_HALF)
    k_first, kv_mask, k1, k2 = _load_heads(k_ptr, token, k_s0, k_s1, num_kv_heads,
                                           HALF, BLOCK_HKV, BLOCK_HALF)
    _, _, v1, v2 = _load_heads(v_ptr, token, v_s0, v_s1, num_kv_heads,
                               HALF, BLOCK_HKV, BLOCK_HALF)
    q1, q2 = _norm_rope(q1, q2, qw1, qw2, cos, sin, eps, HALF)
    tl.store(q_first, q1, mask=q_mask)
    tl.store(q_first + HALF, q2, mask=q_mask)
    k1, k2 = _norm_rope(k1, k2, kw1, kw2, cos, sin, eps, HALF)
    tl.store(k_first, k1, mask=kv_mask)
    tl.store(k_first + HALF, k2, mask=kv_mask)
    if slot >= 0:  # a negative slot: padding row of a graph batch, not stored
        cache = (slot // PAGE) * cache_s0 + (slot % PAGE) * cache_s1 + heads * cache_s2 + dims
        # New names, not k1 = ...: a variable keeps its type across the branch (an FP8 cache's
        # values are float8, the row's bf16).
        stored_k1 = _cache_value(k1, k_scale, FP8).to(k_cache_ptr.dtype.element_ty)
        stored_k2 = _cache_value(k2, k_scale, FP8).to(k_cache_ptr.dtype.element_ty)
        stored_v1 = _cache_value(v1, v_scale, FP8).to(v_cache_ptr.dtype.element_ty)
        stored_v2 = _cache_value(v2, v_scale, FP8).to(v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + cache, stored_k1, mask=kv_mask)
        tl.store(k_cache_ptr + cache + HALF, stored_k2, mask=kv_mask)
        tl.store(v_cache_ptr + cache, stored_v1, mask=kv_mask)
        tl.store(v_cache_ptr + cache + HALF, stored_v2, mask=kv_mask)


def norm_rope_store(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.norm_rope_store``, in place on (possibly strided)
    ``[T, H, D]`` views of a fused projection; returns ``(query, key)``."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.dtype == key.dtype == value.dtype == q_weight.dtype == k_weight.dtype
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0
    for t in (query, key, value, k_cache, cos_sin_cache):
        assert t.stride(-1) == 1
    if num_tokens:
        half = head_dim // 2
        block_h = triton.next_power_of_2(num_heads)
        launch(
            _norm_rope_store_kernel, (num_tokens,),
            query, key, value, q_weight, k_weight, positions, cos_sin_cache,
            k_cache, v_cache, slot_mapping,
            k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_heads, num_kv_heads, eps,
            HALF=half, PAGE=k_cache.shape[1], BLOCK_H=block_h,
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), FP8=fp8,
            num_warps=4 if block_h * half >= 1024 else 1, **pdl_options(query),
        )
    return query, key
