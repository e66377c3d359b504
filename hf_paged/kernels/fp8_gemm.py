"""Block-scaled FP8 projections of more rows than the small-M kernel serves (larger decode
batches, prefill): ``x [M, K] @ W.T`` with ``W`` float8_e4m3fn and its ``BlockScales``.

Three paths; start-up times them per projection shape (``worker/fp8_tuning.py``):

- ``dequant_linear``: the weight tile is converted and scaled in registers, rounded to the
  activations' dtype and multiplied on the 16-bit tensor cores: the plain path's numbers
  (``F.linear`` over ``block_scales.dequantize``) with half its weight bytes.
- ``w8a8_linear``: the activations are quantized first (``act_quant``: per row and group of
  ``block_k`` columns to float8_e4m3fn, scale ``amax / 448``, as transformers' ``act_quant``
  for fine-grained FP8), then each K block of the FP8 tensor cores' product is scaled by
  ``a_scale[m, kb] * inv[rows[n], kb]`` into a float32 accumulator: twice the 16-bit
  tensor cores' rate, at the cost of the activations' rounding to FP8 and one more launch.
- ``cublas_linear``: the whole weight dequantized into a scratch tensor of the activations'
  dtype (``dequantize_weight``), then ``F.linear`` (cuBLAS): ``dequant_linear``'s numbers.
  Writing and reading the scratch costs three bytes an element, which a large GEMM (prefill)
  repays where cuBLAS outruns the Triton GEMMs; the weight stays FP8 in memory, and the
  scratch lives only through the call.
- ``scaled_mm_linear``: ``w8a8_linear``'s numbers on torch's block-scaled FP8 GEMM
  (``F.scaled_mm`` with 1x128 activation and 128x128 weight scales, cuBLAS's kernels; sm_90
  only), where ``scaled_mm_serves`` the weight. Start-up times it against ``w8a8_linear`` and
  the faster serves from ``w8a8_rows`` rows (its loop waits on each K block's product before
  scaling it, which leaves the Triton GEMM's tensor cores idle).

The GEMMs take K in steps of at most one scale block, so a step reads one scale per weight row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hf_paged.kernels.block_scales import FP8, FP8_MAX, MIN_AMAX, BlockScales
from hf_paged.kernels.e4m3 import round_e4m3
from hf_paged.kernels.launch import launch

_GROUPS_PER_PROGRAM = 8
_DEQUANT_TILE = (16, 256)  # weight rows by columns a program of ``dequantize_weight`` converts


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, x_s0, q_s0, s_s0, GROUP: tl.constexpr,
                      GROUPS: tl.constexpr, MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * x_s0 + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX) / MAX
    q = round_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -MAX, MAX))
    tl.store(q_ptr + row * q_s0 + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(s_ptr + row * s_s0 + groups, scale, mask=groups * GROUP < K)


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.act_quant``: ``x [M, K]`` in float8_e4m3fn and its float32
    scales ``[M, ceil(K / group)]``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m:
        launch(_act_quant_kernel, (m, triton.cdiv(scales.shape[1], _GROUPS_PER_PROGRAM)),
               x, q, scales, k, x.stride(0), q.stride(0), scales.stride(0),
               GROUP=group, GROUPS=_GROUPS_PER_PROGRAM, MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
               num_warps=4)
    return q, scales


@triton.jit
def _gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, inv_ptr, rows_ptr, bias_ptr, out_ptr,
    M, N, K, a_s0, a_scale_s0, w_s0, inv_s0, out_s0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    W8A8: tl.constexpr, BIAS: tl.constexpr,
):
    # Programs run along M first within bands of GROUP_M row blocks, so that the weight
    # tiles a band reads are still in L2 for its next row block.
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * blocks_n)
    first_m = band * GROUP_M
    band_m = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % band_m
    pid_n = (pid % (GROUP_M * blocks_n)) // band_m
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_ok, n_ok = ms < M, ns < N
    a_ptrs = a_ptr + ms.to(tl.int64)[:, None] * a_s0 + ks[None, :]
    w_ptrs = w_ptr + ns.to(tl.int64)[None, :] * w_s0 + ks[:, None]  # the tile of W.T
    inv_ptrs = inv_ptr + tl.load(rows_ptr + ns, mask=n_ok, other=0).to(tl.int64) * inv_s0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k
            a = tl.load(a_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w_scale = tl.load(inv_ptrs + k // SCALE_K)
        if W8A8:
            a_scale = tl.load(a_scale_ptr + ms * a_scale_s0 + k // SCALE_K, mask=m_ok,
                              other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        else:  # rounded to the activations' dtype, as block_scales.dequantize rounds
            w = (w.to(tl.float32) * w_scale[None, :]).to(a.dtype)
            acc = tl.dot(a, w, acc, input_precision="ieee")
    if BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + ms.to(tl.int64)[:, None] * out_s0 + ns[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_config(m: int, w8a8: bool) -> dict[str, int]:
    """Tiles and launch settings by row count. Few rows: narrow tiles, so that enough programs
    stream the weight; more rows: wider ones, which reuse each weight tile over more rows.
    Swept on an H100 over the Qwen3-8B projections (the best of 3 to 9 settings a row count
    within about 10% on each shape)."""
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 32, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 128 if w8a8 else 64, 4, 4
    elif m <= 256 or w8a8:  # w8a8: 128x128 tiles of 8 warps took 1.2-1.3x as long
        block_m, block_n, block_k, warps, stages = 64, 128, 128, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 4, 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                num_warps=warps, num_stages=stages)


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor,
          scales: BlockScales, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    m, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features, x has {k}")
    assert a.stride(1) == weight.stride(1) == scales.inv.stride(-1) == 1
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    if m == 0:
        return out
    config = gemm_config(m, a_scale is not None)
    config["BLOCK_K"] = min(config["BLOCK_K"], scales.block_k)
    if scales.block_k % config["BLOCK_K"]:
        raise ValueError(f"scales.block_k ({scales.block_k}) is not a multiple of "
                         f"{config['BLOCK_K']}")
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    launch(_gemm_kernel, grid, a, a if a_scale is None else a_scale, weight, scales.inv,
           scales.rows, a if bias is None else bias, out, m, n, k, a.stride(0),
           0 if a_scale is None else a_scale.stride(0), weight.stride(0),
           scales.inv.stride(0), out.stride(0), SCALE_K=scales.block_k,
           EVEN_K=k % config["BLOCK_K"] == 0, W8A8=a_scale is not None,
           BIAS=bias is not None, **config)
    return out


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``reference.dequant_linear``: ``F.linear`` over the FP8 ``weight``
    dequantized to ``x``'s dtype, tile by tile."""
    return _gemm(x, None, weight, scales, bias, x.dtype)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``reference.w8a8_linear``: ``x`` quantized per group of
    ``scales.block_k`` columns (``act_quant``), multiplied with the FP8 ``weight`` on the FP8
    tensor cores, in ``x``'s dtype."""
    q, a_scale = act_quant(x, scales.block_k)
    return _gemm(q, a_scale, weight, scales, bias, x.dtype)


@triton.jit
def _dequant_kernel(w_ptr, inv_ptr, rows_ptr, out_ptr, N, K, w_s0, inv_s0, out_s0,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr):
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (ns < N)[:, None] & (ks < K)[None, :]
    grid_row = tl.load(rows_ptr + ns, mask=ns < N, other=0).to(tl.int64)
    scale = tl.load(inv_ptr + grid_row[:, None] * inv_s0 + (ks // SCALE_K)[None, :], mask=mask,
                    other=0.0)
    w = tl.load(w_ptr + ns.to(tl.int64)[:, None] * w_s0 + ks[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + ns.to(tl.int64)[:, None] * out_s0 + ks[None, :],
             (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype
                      ) -> torch.Tensor:
    """Triton twin of ``block_scales.dequantize`` for a 2-D weight: each element times its
    block's scale in float32, rounded once to ``dtype``."""
    n, k = weight.shape
    assert weight.stride(1) == scales.inv.stride(-1) == 1
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    block_n, block_k = _DEQUANT_TILE
    if n and k:
        launch(_dequant_kernel, (triton.cdiv(n, block_n), triton.cdiv(k, block_k)), weight,
               scales.inv, scales.rows, out, n, k, weight.stride(0), scales.inv.stride(0),
               out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, SCALE_K=scales.block_k,
               num_warps=4)
    return out


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over the FP8 ``weight`` dequantized whole to ``x``'s dtype: the numbers of
    ``reference.dequant_linear``, on cuBLAS."""
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} input features, x has {x.shape[1]}")
    return F.linear(x, dequantize_weight(weight, scales, x.dtype), bias)


def scaled_mm_serves(weight: torch.Tensor, scales: BlockScales) -> bool:
    """Whether ``scaled_mm_linear`` can take this weight: torch has the block-scaled FP8 GEMM,
    the weight is a 2-D FP8 tensor on an sm_90 GPU (the only one torch gives those scales
    on), its grid has 128x128 blocks in the plain layout (grid row ``n // 128``: every merged
    part a multiple of 128 rows) and K whole blocks, a multiple of four of them (the scales'
    columns start 16-byte aligned). Reads ``scales.rows`` back: for start-up, not a step."""
    recipes = getattr(F, "ScalingType", None)
    if (recipes is None or not hasattr(recipes, "BlockWise128x128") or weight.dim() != 2
            or weight.dtype != FP8 or not weight.is_cuda
            or torch.cuda.get_device_capability(weight.device) != (9, 0)):
        return False
    n, k = weight.shape
    rows = torch.arange(n, dtype=scales.rows.dtype) // 128
    return (scales.block_k == 128 and k % 512 == 0 and n % 128 == 0
            and tuple(scales.inv.shape) == (n // 128, k // 128) and scales.inv.is_contiguous()
            and torch.equal(scales.rows.cpu(), rows))


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``w8a8_linear`` on ``F.scaled_mm`` (where ``scaled_mm_serves``): ``x`` quantized by
    ``act_quant``, each K block's FP8 product scaled by both scales into float32, the bias
    added there, rounded once to ``x``'s dtype."""
    m = x.shape[0]
    pad = -m % 4  # the activations' scales go column-major: rows in 16-byte multiples
    q, a_scale = act_quant(F.pad(x, (0, 0, 0, pad)) if pad else x, scales.block_k)
    out = F.scaled_mm(q, weight.t(), a_scale.t().contiguous().t(),
                      F.ScalingType.BlockWise1x128, scales.inv.t(),
                      F.ScalingType.BlockWise128x128,
                      output_dtype=x.dtype if bias is None else torch.float32)
    out = out[:m] if pad else out
    return out if bias is None else (out + bias.float()).to(x.dtype)
