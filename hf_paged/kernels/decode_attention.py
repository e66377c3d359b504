"""The decode side of ``kernels.attention``: the split-K policy and merge (flash-decoding), the
cascade's shared-prefix kernel, and the newest token's attention inputs computed inside the
decode kernel.

At decode each layer would otherwise run a kernel of its own before attention
(``attention_inputs.norm_rope_store``: per-head RMSNorm and RoPE of q and k, k and v stored in
the cache) for one token a sequence; at small batches its launch and its round trips to memory,
not its bytes, are what it costs. Given ``reference.NewTokens``, the decode kernel does it
instead: each
program normalises and rotates its query heads as it loads them, reads the cached keys before
the newest token, and program 0 of each (sequence, KV head) normalises and rotates the newest
key, stores it and its value in the cache, and adds that key's score to its online softmax from
registers. Every rounding point is ``reference.norm_rope_store``'s.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_paged.kernels.attention_inputs import mul_rounded
from hf_paged.kernels.attention_tiles import attend_tiles
from hf_paged.kernels.gdc import wait_for_previous
from hf_paged.kernels.reference import NewTokens

MAX_SPLITS = 32


def new_token_args(new: NewTokens | None, query: torch.Tensor) -> tuple:
    """The decode kernel's arguments for ``new`` (``query`` stands in for unused pointers)."""
    if new is None:
        return (query,) * 7 + (0.0,) + (0,) * 5
    key, value, cos_sin = new.key, new.value, new.cos_sin_cache
    assert key.dtype == value.dtype == query.dtype == new.q_weight.dtype == new.k_weight.dtype
    assert key.stride(-1) == value.stride(-1) == cos_sin.stride(-1) == 1
    assert cos_sin.shape[1] == query.shape[-1] and query.shape[-1] % 2 == 0
    return (key, value, new.q_weight, new.k_weight, new.positions, cos_sin, new.slot_mapping,
            new.eps, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cos_sin.stride(0))


@triton.jit
def norm_rope_rows(ptrs, mask, w_ptr, cs_row, eps,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of heads at ``ptrs`` (``[R, BLOCK_D]``, contiguous along the head), RMS-normalised
    with weight ``w_ptr`` and rotated by the float32 cos/sin row ``cs_row``, rounded as
    ``reference.rms_norm`` then ``reference.rope``. The rotation's partner of dimension d
    (d + D/2 modulo D) is loaded alongside rather than shuffled in registers."""
    dims = tl.arange(0, BLOCK_D)
    partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
    dim_ok = dims < HEAD_DIM
    x = tl.load(ptrs, mask=mask, other=0.0)
    xp = tl.load(ptrs - dims[None, :] + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0)[None, :]
    wp = tl.load(w_ptr + partner, mask=dim_ok, other=0.0)[None, :]
    half = dims % HALF
    cos = tl.load(cs_row + half, mask=dim_ok, other=0.0).to(dtype)[None, :]
    sin = tl.load(cs_row + HALF + half, mask=dim_ok, other=0.0).to(dtype)[None, :]
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
    n = mul_rounded((xf * inv_rms).to(dtype), w, dtype)
    n_partner = mul_rounded((xpf * inv_rms).to(dtype), wp, dtype)
    # rotate_half: -x2 in the first half, x1 in the second
    sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
    return (mul_rounded(n, cos, dtype).to(tl.float32)
            + sign * mul_rounded(n_partner, sin, dtype).to(tl.float32)).to(dtype)


@triton.jit
def attend_new_token(
    acc, m, denom, q, seq, kv_head, k_cache_ptr, v_cache_ptr, kn_ptr, vn_ptr, kw_ptr,
    cs_row, slot_ptr, eps, scale_log2, kn_s0, kn_s1, vn_s0, vn_s1,
    k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    """Store sequence ``seq``'s newest key (normalised, rotated) and value for ``kv_head`` in
    the cache, and add that key to the online softmax ``(acc, m, denom)`` of queries ``q``."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = (dims < HEAD_DIM)[None, :]
    token = seq.to(tl.int64)
    k = norm_rope_rows(kn_ptr + token * kn_s0 + kv_head * kn_s1 + dims[None, :], dim_ok,
                       kw_ptr, cs_row, eps, HALF, HEAD_DIM, BLOCK_D)
    v = tl.load(vn_ptr + token * vn_s0 + kv_head * vn_s1 + dims[None, :], mask=dim_ok,
                other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block, offset = slot // PAGE, slot % PAGE
        tl.store(k_cache_ptr + block * k_s0 + offset * k_s1 + kv_head * k_s2 + dims[None, :],
                 k, mask=dim_ok)
        tl.store(v_cache_ptr + block * v_s0 + offset * v_s1 + kv_head * v_s2 + dims[None, :],
                 v, mask=dim_ok)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2
    m_new = tl.maximum(m, s)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new)
    denom = denom * alpha + p
    # p is rounded to the value's dtype before the product, as the tiles' ``tl.dot`` takes it.
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return acc, m_new, denom


@triton.jit(do_not_specialize=["num_tokens", "num_parts"],
            do_not_specialize_on_alignment=["table_ptr", "shared_ptr"])
def shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, table_ptr, shared_ptr,
    scale_log2, num_tokens, num_heads, num_parts,
    q_s0, q_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Parts ``0..P-1`` (one per program along axis 2) of every query token's attention over
    the shared prefix: the first ``shared`` keys, rounded down to whole key tiles, held in the
    blocks of ``table_ptr`` and visible to every query."""
    wait_for_previous(PDL)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < num_tokens)
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = tok.to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_s0 + head[:, None] * q_s1 + dims[None, :], mask=mask,
                other=0.0)
    n_tiles = tl.load(shared_ptr) // BLOCK_N
    per_split = tl.cdiv(n_tiles, tl.num_programs(2))
    tile_lo = per_split * split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m, denom = attend_tiles(
        acc, m, denom, q, k_cache_ptr + kv_head * k_s2, v_cache_ptr + kv_head * v_s2, table_ptr,
        tok, n_tiles * BLOCK_N, tile_lo, tile_hi, k_s0, k_s1, v_s0, v_s1, scale_log2,
        BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, False, PRECISION)
    denom = tl.where(denom == 0.0, 1.0, denom)
    part = (q_rows * num_heads + head) * num_parts + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / denom[:, None],
             mask=mask)
    tl.store(part_lse_ptr + part, m + tl.log2(denom), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, o_s0, o_s1,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(
        part_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (row // num_heads) * o_s0 + (row % num_heads) * o_s1 + dims, out,
             mask=dims < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # CPU tensors (Triton's interpreter): act as a 132-SM GPU would


def decode_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Split-K factor for ``programs`` (sequence, KV head) pairs: none once they fill the SMs,
    else enough for about two programs per SM, never more than the key tiles the block table
    can address (its width, not its contents, so the choice is fixed per graph batch)."""
    sms = _sm_count(device)
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, max_tiles, triton.cdiv(2 * sms, programs)))
