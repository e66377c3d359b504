"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5) over a continuous
batch, each sequence's recurrent state ``[Hv, K, V]`` float32 in a pool slot: the one-token
decode (twin: ``reference_gated_delta``) and the pieces the chunked prefill
(``gated_delta_chunked``) shares with it.

Decode: one program per (sequence, value head, V tile) reads its state tile, applies the
token's update and writes it back; a negative slot (a padding row of a CUDA-graph batch)
writes a zero output and no state. It reads no value on the host, and its grid follows the
shapes alone: a CUDA graph replays it for any slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_gated_delta import L2NORM_EPS, check_gated_delta

# The decode's V tile and warps by batch rows. Measured on an H100 at Qwen3.5-9B's linear
# layers (32 value heads, K = V = 128), the state read and written at 2.4-2.7 TB/s: up to 32
# rows, tiles of 32 columns on two warps (B * Hv * 4 programs, enough to spread one
# sequence's 2 MB state over the SMs: 32 us at one row against 47 with four warps); above,
# 64 columns on four (0.41 ms at 256 rows against 0.45 for 32 columns). The tile sets the
# sums' order, and 32 is a rung of the decode graphs' ladder: a batch padded to its graph's
# size keeps the tile (and so the bits) of the same batch run eagerly.
_DECODE_TILES = ((33, 32, 2), (None, 64, 4))  # (rows below, BV, warps)
_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def unit_lower_inverse(a, C: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower triangular ``a [C, C]``: row ``i`` of the inverse
    ``X`` is ``e_i - sum_{j<i} a[i, j] X[j]`` (``X = I - a X``), one row a step. Rows are
    picked by masked sums (registers cannot be indexed); ``a``'s row ``i`` is taken as
    column ``i`` of its transpose, so that it lies along the axis the product sums over."""
    rows = tl.arange(0, C)
    a_t = tl.trans(a)
    x = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows[None, :] == i, a_t, 0.0), axis=1)
        below = tl.sum(a_i[:, None] * x, axis=0)
        x = tl.where(rows[:, None] == i, x - below[None, :], x)
    return x


@triton.jit
def l2norm(x, ON: tl.constexpr):
    """transformers' l2norm along the last axis (``x * rsqrt(sum(x*x) + eps)``), if ``ON``."""
    if ON:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + _EPS))
    return x


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, initial_ptr, scale,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, b_s0, o_s0, o_s1, p_s0, p_s1, p_s2,
    REPEATS: tl.constexpr, L2NORM: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_head = head // REPEATS
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # masks, not an early return: a padding row still writes its zeros
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K_DIM, vs < V_DIM
    s_ptrs = (pool_ptr + tl.maximum(slot, 0) * p_s0 + head * p_s1
              + (ks[:, None] * p_s2 + vs[None, :]))
    s_mask = tl.where(live, k_ok[:, None] & v_ok[None, :], False)
    reads = s_mask
    if HAS_INITIAL:  # a sequence's first token starts from zeros, not the slot
        reads = tl.where(tl.load(initial_ptr + seq) != 0, s_mask, False)
    # The state tile's load is issued first, the token's small loads under it (0.41 ms at 256
    # rows on an H100 against 0.42 the other way round).
    state = tl.load(s_ptrs, mask=reads, other=0.0)
    q = tl.load(q_ptr + seq * q_s0 + kv_head * q_s1 + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * k_s0 + kv_head * k_s1 + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * v_s0 + head * v_s1 + vs, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * g_s0 + head)
    beta = tl.load(beta_ptr + seq * b_s0 + head).to(tl.float32)
    q = l2norm(q, L2NORM) * scale
    k = l2norm(k, L2NORM)
    state = state * tl.exp(g)
    # transformers' order: decay, read the key's prediction, write the correction, read q
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * delta[None, :]
    out = tl.where(live, tl.sum(state * q[:, None], axis=0), 0.0)
    tl.store(out_ptr + seq * o_s0 + head * o_s1 + vs, out.to(out_ptr.dtype.element_ty),
             mask=v_ok)
    tl.store(s_ptrs, state, mask=s_mask)


def strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, out: torch.Tensor, state_pool: torch.Tensor) -> tuple[int, ...]:
    """The strides both kernels take; every last dimension must be contiguous (wide loads)."""
    for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool).items():
        if x.stride(-1) != 1:
            raise ValueError(f"gated delta kernels: {name}'s last dimension is not contiguous")
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), out.stride(0), out.stride(1), *state_pool.stride()[:3])


def heads_shapes(q: torch.Tensor, v: torch.Tensor, tile: int) -> dict[str, int]:
    k_dim, v_dim = q.shape[2], v.shape[2]
    block_v = min(max(triton.next_power_of_2(v_dim), 16), tile)  # tl.dot's least is 16
    return dict(REPEATS=v.shape[1] // q.shape[1], K_DIM=k_dim, V_DIM=v_dim,
                BK=max(triton.next_power_of_2(k_dim), 16), BV=block_v)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                       use_qk_l2norm: bool = True, scale: float | None = None,
                       has_initial: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``reference.gated_delta_decode`` (same arguments and result)."""
    check_gated_delta("gated_delta_decode", q, k, v, g, beta, state_pool, slots,
                      has_initial=has_initial)
    if has_initial is not None and has_initial.dtype == torch.bool:
        has_initial = has_initial.view(torch.uint8)  # a view: no launch, no copy
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if slots.numel() == 0:
        return out
    tile, warps = next((bv, w) for rows, bv, w in _DECODE_TILES
                       if rows is None or slots.numel() < rows)
    shapes = heads_shapes(q, v, tile)
    launch(_decode_kernel, (slots.numel(), v.shape[1], triton.cdiv(v.shape[2], shapes["BV"])),
           q, k, v, g, beta, out, state_pool, slots,
           slots if has_initial is None else has_initial,
           q.shape[2] ** -0.5 if scale is None else scale,
           *strides(q, k, v, g, beta, out, state_pool), L2NORM=use_qk_l2norm,
           HAS_INITIAL=has_initial is not None, num_warps=warps, **pdl_options(q), **shapes)
    return out
