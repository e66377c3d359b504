"""Qwen3's attention inputs in one pass per token: per-head RMSNorm of q and k, RoPE on both
(in place), and k and v written into the paged cache (an FP8 cache: divided by their KV head's
scale, saturated, rounded to nearest even). Four kernels would each launch once per layer and
step; at small batches launches, not bytes, bound the step.

Qwen3-Next and Qwen3.5 use it too: their norms are zero-centred (``OFFSET``) and their RoPE
partial. A head is read in three pieces: the two halves of its first ``2 * HALF`` dimensions,
which rotate, and the ``REST`` after them, which pass (none under full RoPE)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.e4m3 import round_e4m3
from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch


@triton.jit
def _mul(a, b, dtype: tl.constexpr):
    """A product rounded to ``dtype``, as a tensor op in that dtype would."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(dtype)


@triton.jit
def _cache_value(x, scale, FP8: tl.constexpr):
    """``x`` as the cache stores it: ``reference.quantize_kv`` into an FP8 cache, rounded
    by ``round_e4m3`` so that the cast only converts an exact value."""
    if FP8:
        # IEEE division, as torch's (``/`` on float32 is an approximate one on the GPU).
        y = round_e4m3(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0))
        stored = y.to(tl.float8e4nv)
    else:  # one return after an if/else: the GPU compiler rejected an early return's other type
        stored = x
    return stored


@triton.jit
def _load_heads(ptr, token, s0, s1, num_heads, HALF: tl.constexpr, REST: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """One token's heads in three pieces: (each head's address, the halves' mask, the rest's
    mask, first half, second half, rest)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    rest_dims = tl.arange(0, BLOCK_REST)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    rest_mask = (heads < num_heads) & (rest_dims < REST)
    base = ptr + token * s0 + heads * s1
    return (base, mask, rest_mask, tl.load(base + dims, mask=mask, other=0.0),
            tl.load(base + HALF + dims, mask=mask, other=0.0),
            tl.load(base + 2 * HALF + rest_dims, mask=rest_mask, other=0.0))


@triton.jit
def _scaled(x, inv_rms, w, OFFSET: tl.constexpr):
    """A normalised piece as ``reference.rms_norm`` rounds it: Qwen3's (normalised in
    float32, cast back, then scaled) or the zero-centred (times ``1 + w`` in float32, cast
    once)."""
    dtype = x.dtype
    if OFFSET:
        out = (x.to(tl.float32) * inv_rms[:, None] * (1.0 + w.to(tl.float32))).to(dtype)
    else:
        out = _mul((x.to(tl.float32) * inv_rms[:, None]).to(dtype), w, dtype)
    return out


@triton.jit
def _norm_rope(x1, x2, x3, w1, w2, w3, cos, sin, eps, HALF: tl.constexpr, REST: tl.constexpr,
               OFFSET: tl.constexpr):
    """Normalise loaded heads (over all their dimensions) and rotate their first two pieces;
    every rounding point follows ``reference.rms_norm`` then ``reference.rope``."""
    dtype = x1.dtype
    f1, f2, f3 = x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
                        + tl.sum(f3 * f3, axis=1)) / (2 * HALF + REST) + eps)
    n1 = _scaled(x1, inv_rms, w1, OFFSET)
    n2 = _scaled(x2, inv_rms, w2, OFFSET)
    out1 = (_mul(n1, cos, dtype).to(tl.float32) - _mul(n2, sin, dtype).to(tl.float32)).to(dtype)
    out2 = (_mul(n2, cos, dtype).to(tl.float32) + _mul(n1, sin, dtype).to(tl.float32)).to(dtype)
    return out1, out2, _scaled(x3, inv_rms, w3, OFFSET)


@triton.jit
def _store(base, x1, x2, x3, mask, rest_mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
           BLOCK_REST: tl.constexpr):
    """Heads in three pieces to their addresses ``base`` (``[heads, 1]``)."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    tl.store(base + dims, x1, mask=mask)
    tl.store(base + HALF + dims, x2, mask=mask)
    tl.store(base + 2 * HALF + tl.arange(0, BLOCK_REST)[None, :], x3, mask=rest_mask)


# The per-token indices may be views into a graph's packed inputs at any offset: their
# alignment is left out of the compiled variant (one variant for graphs and eager steps).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_ptr"])
def _norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cos_sin_s0, cache_s0, cache_s1, cache_s2,
    num_heads, num_kv_heads, eps,
    HALF: tl.constexpr, REST: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    OFFSET: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    # Every load is issued first: at small batches each dependent round trip to memory, not
    # the bytes, is what a step waits for. What no kernel of the step writes (the norms'
    # weights, the step's positions and slots, the rotary table) is read before waiting for
    # the previous kernel (``kernels.gdc``); q, k and v, its outputs, after.
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    rest_dims = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
    half_ok, rest_ok = dims < HALF, rest_dims < 2 * HALF + REST
    qw1 = tl.load(q_weight_ptr + dims, mask=half_ok, other=0.0)
    qw2 = tl.load(q_weight_ptr + HALF + dims, mask=half_ok, other=0.0)
    qw3 = tl.load(q_weight_ptr + rest_dims, mask=rest_ok, other=0.0)
    kw1 = tl.load(k_weight_ptr + dims, mask=half_ok, other=0.0)
    kw2 = tl.load(k_weight_ptr + HALF + dims, mask=half_ok, other=0.0)
    kw3 = tl.load(k_weight_ptr + rest_dims, mask=rest_ok, other=0.0)
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
    q_base, q_mask, q_rest_mask, q1, q2, q3 = _load_heads(
        q_ptr, token, q_s0, q_s1, num_heads, HALF, REST, BLOCK_H, BLOCK_HALF, BLOCK_REST)
    k_base, kv_mask, kv_rest_mask, k1, k2, k3 = _load_heads(
        k_ptr, token, k_s0, k_s1, num_kv_heads, HALF, REST, BLOCK_HKV, BLOCK_HALF, BLOCK_REST)
    _, _, _, v1, v2, v3 = _load_heads(v_ptr, token, v_s0, v_s1, num_kv_heads, HALF, REST,
                                      BLOCK_HKV, BLOCK_HALF, BLOCK_REST)
    q1, q2, q3 = _norm_rope(q1, q2, q3, qw1, qw2, qw3, cos, sin, eps, HALF, REST, OFFSET)
    _store(q_base, q1, q2, q3, q_mask, q_rest_mask, HALF, BLOCK_HALF, BLOCK_REST)
    k1, k2, k3 = _norm_rope(k1, k2, k3, kw1, kw2, kw3, cos, sin, eps, HALF, REST, OFFSET)
    _store(k_base, k1, k2, k3, kv_mask, kv_rest_mask, HALF, BLOCK_HALF, BLOCK_REST)
    if slot >= 0:  # a negative slot: padding row of a graph batch, not stored
        # A name keeps its type across the branch: ``cache``, not ``row`` (the rotary table's
        # pointer), and new values, not k1 = ... (an FP8 cache's are float8, the row's bf16);
        # the cache's dtype is spelled out, as the compiler names no dtype inside a branch.
        cache = (slot // PAGE) * cache_s0 + (slot % PAGE) * cache_s1 + heads * cache_s2
        _store(k_cache_ptr + cache,
               _cache_value(k1, k_scale, FP8).to(k_cache_ptr.dtype.element_ty),
               _cache_value(k2, k_scale, FP8).to(k_cache_ptr.dtype.element_ty),
               _cache_value(k3, k_scale, FP8).to(k_cache_ptr.dtype.element_ty), kv_mask,
               kv_rest_mask, HALF, BLOCK_HALF, BLOCK_REST)
        _store(v_cache_ptr + cache,
               _cache_value(v1, v_scale, FP8).to(v_cache_ptr.dtype.element_ty),
               _cache_value(v2, v_scale, FP8).to(v_cache_ptr.dtype.element_ty),
               _cache_value(v3, v_scale, FP8).to(v_cache_ptr.dtype.element_ty), kv_mask,
               kv_rest_mask, HALF, BLOCK_HALF, BLOCK_REST)


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
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.norm_rope_store``, in place on (possibly strided)
    ``[T, H, D]`` views of a fused projection; returns ``(query, key)``."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary = cos_sin_cache.shape[1]
    assert query.dtype == key.dtype == value.dtype == q_weight.dtype == k_weight.dtype
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert rotary <= head_dim and rotary % 2 == 0
    for t in (query, key, value, k_cache, cos_sin_cache):
        assert t.stride(-1) == 1
    if num_tokens:
        half, rest = rotary // 2, head_dim - rotary
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
            HALF=half, REST=rest, PAGE=k_cache.shape[1], BLOCK_H=block_h,
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(max(rest, 1)), OFFSET=offset, FP8=fp8,
            num_warps=4 if block_h * head_dim >= 2048 else 1, **pdl_options(query),
        )
    return query, key
