"""The experts of a mixture-of-experts layer as grouped GEMMs over the routed (token, slot)
pairs, in four steps and four or five launches, none of them waiting on the host:

1. ``moe_routing.moe_align`` groups the pairs by expert, padded to blocks of ``BLOCK_M``;
2. the gate/up kernel computes, per block of one expert's pairs, the gate tile and the
   matching up tile of ``x @ w13[e].T`` in two float32 accumulators and stores
   ``silu(gate) * up`` for each pair (the SwiGLU fused: no ``[P, 2I]`` intermediate);
3. the down kernel computes ``act @ w2[e].T`` per pair, times the pair's routing weight;
4. a small kernel sums each token's k rows in float32 (no atomics: the result is the same on
   every run, whatever the order of pairs inside a group).

The casts are transformers' (its grouped_mm experts): gate and up, silu(gate), their product
and each expert's output are rounded to the model dtype, and the k weighted outputs are summed
in float32 once.

Block-quantized FP8 experts (``kernels.block_scales``) take the same path with ``FP8`` set:
the weight tile is loaded as float8_e4m3fn (half the bytes of bf16, what decode is bound by)
and dequantized in registers, times its output columns' scales in float32 and rounded once to
the activations' dtype (the reference's dequantization), before the same product. A K step
never crosses a 128-column scale block, so one scale per output column and step is all the
tile needs. Scaling the weight tile rather than each step's product keeps the accumulator
chained through the products: on an H100, scaling products ran prefill 2-3x slower.

Both GEMMs launch a program for every block that the pairs could need (sized from the shapes,
as CUDA graphs need); programs of blocks past the used slots exit at once, so a small batch
reads only the weights of the experts it routes to.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from hf_paged.kernels.block_scales import BlockScales
from hf_paged.kernels.launch import launch
from hf_paged.kernels.moe_routing import moe_align
from hf_paged.kernels.moe_tiles import MoEConfig, moe_config

_SUM_BLOCK = 1024


@triton.jit
def _tile(num_blocks, num_n, GROUP_M: tl.constexpr):
    """This program's (block, N tile), ``GROUP_M`` blocks walking the N tiles together."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first = pid // per_group * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + pid % per_group % size, pid % per_group // size


@triton.jit
def _load(ptrs, mask, k_mask, EVEN_K: tl.constexpr):
    """A tile masked by ``mask``, and along K by ``k_mask`` unless whole steps fill the
    reduction (EVEN_K): no mask along the contiguous K keeps the loads 16 bytes wide."""
    if EVEN_K:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs, mask=mask & k_mask, other=0.0)


@triton.jit
def _dot(acc, a, w_ptrs, w_mask, k_mask, s_ptrs, k, PRECISION: tl.constexpr,
         EVEN_K: tl.constexpr, FP8: tl.constexpr, SCALE_K: tl.constexpr):
    """``acc`` plus the K step at ``k`` of ``a @ w``; FP8: the weight tile dequantized first,
    times the ``[BLOCK_N]`` scales at ``s_ptrs`` of the step's K block."""
    w = _load(w_ptrs + k, w_mask, k_mask, EVEN_K)
    if FP8:
        scale = tl.load(s_ptrs + k // SCALE_K)
        w = (w.to(tl.float32) * scale[None, :]).to(a.dtype)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _scale_ptrs(s_ptr, rows_ptr, expert, s_se, s_sn, cols, n, FP8: tl.constexpr):
    """Where the scales of output columns ``cols`` start for ``expert``: the grid row that
    each weight row reads (``BlockScales.rows``; row 0 past ``n``, loaded but unused)."""
    rows = cols.to(tl.int64) * 0  # unread for plain weights (one return type for both)
    if FP8:
        rows = tl.load(rows_ptr + cols, mask=cols < n, other=0).to(tl.int64)
    return s_ptr + expert * s_se + rows * s_sn


# Integers that follow the token count are not specialised on (divisibility by 16, equality to
# 1): serving a new batch size compiles nothing.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, rows_ptr, out_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs,
    num_blocks, inter, hidden, x_s0, w_se, w_sn, s_se, s_sn, out_s0,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_K: tl.constexpr,
):
    block, tile = _tile(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * x_s0 + ks[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's gate rows and of its up rows ``inter`` below.
    g_ptrs = w_ptr + expert * w_se + cols.to(tl.int64)[None, :] * w_sn + ks[:, None]
    u_ptrs = g_ptrs + inter * w_sn
    gs_ptrs = _scale_ptrs(s_ptr, rows_ptr, expert, s_se, s_sn, cols, inter, FP8)
    us_ptrs = _scale_ptrs(s_ptr, rows_ptr + inter, expert, s_se, s_sn, cols, inter, FP8)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_ok = cols[None, :] < inter
    for k in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k
        x = _load(x_ptrs + k, valid[:, None], k_ok[None, :], EVEN_K)
        gate = _dot(gate, x, g_ptrs, w_ok, k_ok[:, None], gs_ptrs, k, PRECISION, EVEN_K, FP8,
                    SCALE_K)
        up = _dot(up, x, u_ptrs, w_ok, k_ok[:, None], us_ptrs, k, PRECISION, EVEN_K, FP8,
                  SCALE_K)
    # transformers' cast points: gate and up in the model dtype, then silu(gate) rounded to
    # it, then the product (rounded as it is stored); no-ops in float32.
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * out_s0 + cols[None, :],
             act.to(dtype), mask=valid[:, None] & (cols[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_down_kernel(
    act_ptr, w_ptr, s_ptr, rows_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    used_ptr, num_pairs, num_blocks, hidden, inter, act_s0, w_se, w_sn, s_se, s_sn, out_s0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_K: tl.constexpr,
):
    block, tile = _tile(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * act_s0 + ks[None, :]
    w_ptrs = w_ptr + expert * w_se + cols.to(tl.int64)[None, :] * w_sn + ks[:, None]
    s_ptrs = _scale_ptrs(s_ptr, rows_ptr, expert, s_se, s_sn, cols, hidden, FP8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_ok = cols[None, :] < hidden
    for k in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k
        a = _load(a_ptrs + k, valid[:, None], k_ok[None, :], EVEN_K)
        acc = _dot(acc, a, w_ptrs, w_ok, k_ok[:, None], s_ptrs, k, PRECISION, EVEN_K, FP8,
                   SCALE_K)
    # The expert's output in the model dtype, then times its weight: transformers' casts.
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * out_s0 + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < hidden))


@triton.jit
def _moe_sum_kernel(rows_ptr, ids_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        # a pair of expert -1 (another rank's) computed no row: it adds nothing (the id read
        # for every column, one address: a single load)
        expert = tl.load(ids_ptr + token * TOP_K + slot + tl.zeros([BLOCK], tl.int64))
        acc += tl.load(rows_ptr + (token * TOP_K + slot) * hidden + cols,
                       mask=mask & (expert >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_args(w: torch.Tensor, scales: BlockScales | None, rows: int) -> tuple:
    """The kernels' scale arguments of ``w`` (grid, grid rows, the grid's expert and row
    strides); placeholders, never read, for plain weights."""
    if scales is None:
        return w, w, 0, 0
    inv = scales.inv
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block-scaled expert weights must be float8_e4m3fn, not {w.dtype}")
    if (scales.rows.shape != (rows,) or inv.dim() != 3 or inv.shape[0] != w.shape[0]
            or inv.shape[2] != triton.cdiv(w.shape[2], scales.block_k)):
        raise ValueError(f"scales of grid {tuple(inv.shape)} and {scales.rows.numel()} rows "
                         f"do not fit expert weights {tuple(w.shape)}")
    assert inv.dtype == torch.float32 and inv.stride(2) == 1
    return inv, scales.rows, inv.stride(0), inv.stride(1)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, config: MoEConfig | None = None,
                w13_scales: BlockScales | None = None, w2_scales: BlockScales | None = None,
                ) -> torch.Tensor:
    """Triton twin of ``reference.moe_experts``: ``x [T, H]`` through the experts
    ``ids [T, k]`` (distinct in a row; -1: none of these, the pair adds nothing) of
    ``w13 [E, 2I, H]`` (gate rows, then up rows) and
    ``w2 [E, H, I]``, weighted by ``weights [T, k]`` and summed per token; ``[T, H]`` in
    ``x``'s dtype. ``config`` overrides ``moe_config``'s tiles. ``w13_scales`` /
    ``w2_scales`` (both or neither): the experts are float8_e4m3fn with these block scales."""
    tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and weights.shape == ids.shape
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1
    fp8 = w13_scales is not None
    if fp8 != (w2_scales is not None) or (fp8 and w13_scales.block_k != w2_scales.block_k):
        raise ValueError("w13_scales and w2_scales: both or neither, with one block_k")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    cfg = config or moe_config(tokens, num_experts, top_k, inter, hidden, x.dtype, fp8=fp8)
    scale_k = w13_scales.block_k if fp8 else cfg.block_k
    if config is None and fp8 and scale_k < cfg.block_k and not scale_k & (scale_k - 1):
        # narrower scale columns than the tile (64-wide blocks): a K step within one
        cfg = dataclasses.replace(cfg, block_k=scale_k)
    if scale_k % cfg.block_k:
        raise ValueError(f"config.block_k={cfg.block_k} must divide the scales' {scale_k}")
    ids = ids.contiguous()
    sorted_pairs, block_expert, used = moe_align(ids, num_experts, cfg.block_m)
    pairs, blocks = tokens * top_k, block_expert.numel()
    # float32 products in full precision (not TF32), as torch's matmul by default; the half
    # types ignore it
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, PRECISION=precision, FP8=fp8, SCALE_K=scale_k,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    s13, rows13, s13_se, s13_sn = _scale_args(w13, w13_scales, 2 * inter)
    s2, rows2, s2_se, s2_sn = _scale_args(w2, w2_scales, hidden)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    launch(_moe_gate_up_kernel, (blocks * triton.cdiv(inter, cfg.block_n),),
           x, w13, s13, rows13, act, sorted_pairs, block_expert, used, pairs, blocks, inter,
           hidden, x.stride(0), w13.stride(0), w13.stride(1), s13_se, s13_sn, act.stride(0),
           TOP_K=top_k, EVEN_K=hidden % cfg.block_k == 0, **meta)
    rows = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    launch(_moe_down_kernel, (blocks * triton.cdiv(hidden, cfg.block_n),),
           act, w2, s2, rows2, weights.contiguous(), rows, sorted_pairs, block_expert, used,
           pairs, blocks, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), s2_se,
           s2_sn, rows.stride(0), EVEN_K=inter % cfg.block_k == 0, **meta)
    launch(_moe_sum_kernel, (tokens, triton.cdiv(hidden, _SUM_BLOCK)), rows, ids, out,
           hidden, TOP_K=top_k, BLOCK=_SUM_BLOCK)
    return out
