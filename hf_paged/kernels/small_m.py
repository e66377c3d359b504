"""Projections of a few rows (decode at small batches): ``x [M, K] @ W.T`` for M up to
``MAX_ROWS``.

At batch 1 a projection reads its whole weight for one row of output: it is bound by memory
latency and bandwidth, and cuBLAS's kernels for it are not (on an H200, inside CUDA graphs,
over the 28 layers' weights of Qwen3-0.6B: qkv 5.2 us against this kernel's 4.1, o_proj 12.6
against 3.3, gate/up 6.0 against 5.1, down 6.5 against 4.0; the tensor-core tiles this kernel
used before, 16 weight rows by 256, lost to cuBLAS on all but o_proj). So a program reads a
strip of ``BLOCK_N`` weight rows (1 to 8: 16 KB of weights) across up to 4,096 columns at a
time, as wide 16-byte loads, multiplies it elementwise with one row of ``x`` and reduces along
K: many small programs keep the whole weight in flight at once. Row ``m`` of ``x`` is
``program_id(1)``: a second row's programs read the strip from L2, not from memory. The
merged gate/up projection can produce its SwiGLU product in the same pass (``gated_linear``),
which saves the activation's launch, and any projection can RMS-normalise its input first,
after the residual add (``normed_linear``), which saves the norm's launch. Start-up still
measures both kernels per projection shape (``worker/projection_tuning.py``) and uses this one
only where it wins.

Block-quantized FP8 weights (``kernels.block_scales``) take the same path with ``scales``: the
strip is loaded as FP8 (16-byte loads of 16 elements, twice a bf16 strip's elements for the
same bytes in flight), converted in registers and multiplied in float32 like a 16-bit weight;
each 128-column block's sum is then multiplied by its row's scale (``worker/fp8_tuning.py``
chooses its rows). The dequantized weight is never rounded to 16 bits, so the result differs
from the plain path's ``dequantize`` then ``F.linear`` by float32 rounding, not by bf16's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.block_scales import BlockScales
from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch

MAX_ROWS = 8
_MAX_BLOCK_K = 4096
# Weight elements a program holds: a strip of BLOCK_N rows by a whole row (up to 4,096 columns)
# at once. Under programmatic dependent launch (``kernels.gdc``) the whole strip is loaded
# before the kernel waits for the previous one, so its reads overlap that kernel's end. Swept
# on an H100 at one row over Qwen3-0.6B's 28 layers in a graph: the four projections took
# 468 us against 502 with 2-4-row strips of 1,024 columns (within 2% of each shape's best).
_PROGRAM_ELEMENTS = 8192
# The same for FP8 weights (a byte an element): the same 16 KB of weights in flight. On an
# H100 at one row, 8,192 FP8 elements took 3-11% longer on each Qwen3-8B projection.
_FP8_PROGRAM_ELEMENTS = 16384
# Warps of an FP8 program whose strip spans the whole row in one pass (K up to _MAX_BLOCK_K):
# on an H100 at one row over Qwen3-8B's 36 layers in a graph, 4 warps took 375 us on qkv
# against 398 with 8, 273 against 275 on o_proj and 1,413 against 1,557 on gate/up, while down
# (K 12,288: three passes) took 648 with 8 against 687 or more with 4. bf16 strips keep 8.
_FP8_ONE_PASS_WARPS = 4


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, out_ptr, N, K, x_s0, w_s0, out_s0,
    res_ptr, res_out_ptr, norm_ptr, eps, res_s0, res_out_s0, inv_ptr, rows_ptr, inv_s0,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr,
):
    # GATED: the weight is [gate; up] (2N rows) and the output silu(x @ gate.T) * (x @ up.T),
    # each product rounded to the output dtype first, as silu_and_mul(F.linear(x, w)).
    # NORM: x is first RMS-normalised with weight ``norm_ptr``, after adding the residual
    # (RESIDUAL), rounded at every point where the norm kernels round; program 0 of each row
    # writes x + residual to ``res_out_ptr`` (a new tensor: the others still read the old).
    # SCALE_K > 0: the weight is block-quantized FP8; row n's block j of SCALE_K columns is
    # scaled by ``inv[rows[n], j]`` (``kernels.block_scales``).
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols[:, None] < N
    w_inv = inv_ptr  # each strip row's scale row, read once (unused without SCALE_K)
    u_inv = inv_ptr
    if SCALE_K:
        w_inv = inv_ptr + tl.load(rows_ptr + cols, mask=cols < N, other=0).to(tl.int64) * inv_s0
        if GATED:
            u_inv = inv_ptr + tl.load(rows_ptr + N + cols, mask=cols < N,
                                      other=0).to(tl.int64) * inv_s0
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_s0 + ks[None, :]
    x_ptrs = x_ptr + row * x_s0 + ks
    res_ptrs = res_ptr + row * res_s0 + ks
    # The first chunk of the weight is loaded before anything else, so that its latency
    # overlaps the previous kernel's end (no kernel of a step writes weights) and the norm's
    # pass over the row; the loop over K starts at the second chunk.
    w = _load(w_ptrs, col_ok & (ks < K)[None, :], EVEN)
    u = _load(w_ptrs + N * w_s0, col_ok & (ks < K)[None, :], EVEN) if GATED else w
    wait_for_previous(PDL)
    inv_rms = 1.0
    if NORM:  # a first pass over the row (from L2: every program reads it) for its RMS
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = _input(x_ptrs + k, res_ptrs + k, ks < K - k, RESIDUAL, False)
            if RESIDUAL:
                if tl.program_id(0) == 0:
                    tl.store(res_out_ptr + row * res_out_s0 + ks + k, x, mask=ks < K - k)
            squares += x.to(tl.float32) * x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc, up = _chunk(w, u, w_inv, u_inv, 0, K, x_ptrs, res_ptrs, norm_ptr + ks, ks < K,
                     inv_rms, GATED, NORM, RESIDUAL, EVEN, SCALE_K)
    for k in range(BLOCK_K, K, BLOCK_K):
        k_ok = ks < K - k  # unused where EVEN: no masks, so the loads stay 16 bytes wide
        w = _load(w_ptrs + k, col_ok & k_ok[None, :], EVEN)
        u = _load(w_ptrs + N * w_s0 + k, col_ok & k_ok[None, :], EVEN) if GATED else w
        a, b = _chunk(w, u, w_inv, u_inv, k, K, x_ptrs + k, res_ptrs + k, norm_ptr + ks + k,
                      k_ok, inv_rms, GATED, NORM, RESIDUAL, EVEN, SCALE_K)
        acc += a
        up += b
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_s0 + cols, acc.to(dtype), mask=cols < N)


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _chunk(w, u, w_inv, u_inv, k, K, x_ptrs, res_ptrs, norm_ptrs, k_ok, inv_rms,
           GATED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, EVEN: tl.constexpr,
           SCALE_K: tl.constexpr):
    """One chunk along K, from column ``k``: the products of weight rows ``w`` (and, GATED,
    ``u``) with the input's chunk, normed first under NORM."""
    x = _input(x_ptrs, res_ptrs, k_ok, RESIDUAL and NORM, EVEN)
    if NORM:
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
        x = (normed * _load(norm_ptrs, k_ok, EVEN).to(tl.float32)).to(x.dtype)
    gate = _row_sums(w, w_inv, x, k, K, SCALE_K, EVEN)
    if GATED:
        return gate, _row_sums(u, u_inv, x, k, K, SCALE_K, EVEN)
    return gate, tl.zeros_like(gate)


@triton.jit
def _row_sums(w, inv_ptrs, x, k, K, SCALE_K: tl.constexpr, EVEN: tl.constexpr):
    """Each strip row's product with the input chunk ``x``, in float32. With SCALE_K the FP8
    values are summed block by block and each block's sum is multiplied by its scale
    (``inv_ptrs``: each strip row's scale row), so an element costs its conversion and one
    multiply-add: a multiply and two conversions fewer than scaling and rounding each element
    (2-3% faster over the 8B projections at one row on an H100, which still reads FP8
    strips at 2.4-2.6 TB/s against bf16's 3.0)."""
    products = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if SCALE_K:
        BLOCK_N: tl.constexpr = w.shape[0]
        BLOCK_K: tl.constexpr = w.shape[1]
        blocks = k // SCALE_K + tl.arange(0, BLOCK_K // SCALE_K)
        scale = _load(inv_ptrs[:, None] + blocks[None, :],
                      (blocks < tl.cdiv(K, SCALE_K))[None, :], EVEN)
        sums = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // SCALE_K, SCALE_K)), axis=2)
        return tl.sum(sums * scale, axis=1)
    return tl.sum(products, axis=1)


@triton.jit
def _input(x_ptrs, res_ptrs, mask, RESIDUAL: tl.constexpr, EVEN: tl.constexpr):
    """A chunk of a row of x, plus the residual's (the sum rounded as ``x + residual``)."""
    x = _load(x_ptrs, mask, EVEN)
    if RESIDUAL:
        res = _load(res_ptrs, mask, EVEN)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
    return x


def _launch(x: torch.Tensor, weight: torch.Tensor, gated: bool,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
            scales: BlockScales | None = None) -> torch.Tensor:
    """The kernel over ``x``; with ``norm_weight``, ``x`` (plus ``residual``, written to
    ``residual_out``) is RMS-normalised first; with ``scales``, ``weight`` is block-quantized
    FP8. Unused pointers are given ``x``."""
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == weight.stride(1) == 1
    n, k = weight.shape
    n //= 1 + gated
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    res = x if residual is None else residual
    res_out = x if residual_out is None else residual_out
    inv, rows, scale_k = (x, x, 0) if scales is None else _scale_args(scales)
    if x.shape[0]:
        block_k = max(min(_MAX_BLOCK_K, triton.next_power_of_2(k)), scale_k)
        elements = _PROGRAM_ELEMENTS if scales is None else _FP8_PROGRAM_ELEMENTS
        block_n = max(1, elements // (block_k * (1 + gated)))
        warps = _FP8_ONE_PASS_WARPS if scales is not None and k <= block_k else 8
        launch(
            _small_m_kernel, (triton.cdiv(n, block_n), x.shape[0]),
            x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
            res, res_out, x if norm_weight is None else norm_weight, eps, res.stride(0),
            res_out.stride(0), inv, rows, inv.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN=n % block_n == 0 and k % block_k == 0,
            GATED=gated, NORM=norm_weight is not None, RESIDUAL=residual is not None,
            SCALE_K=scale_k, num_warps=warps, num_stages=1, **pdl_options(x),
        )
    return out


def _scale_args(scales: BlockScales) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's scale grid, grid rows and block width; the block width a power of two
    (a strip chunk holds whole blocks)."""
    if scales.block_k < 16 or scales.block_k & (scales.block_k - 1):
        raise ValueError(f"scales.block_k ({scales.block_k}) is not a power of two >= 16")
    assert scales.inv.dim() == 2 and scales.inv.stride(1) == 1
    return scales.inv, scales.rows, scales.block_k


def linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales | None = None
           ) -> torch.Tensor:
    """Triton twin of ``F.linear`` (no bias) for ``x [M <= MAX_ROWS, K]``; with ``scales``,
    of ``F.linear`` over the dequantized FP8 ``weight``."""
    return _launch(x, weight, gated=False, scales=scales)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales | None = None
                 ) -> torch.Tensor:
    """Triton twin of ``silu_and_mul(F.linear(x, weight))`` for a merged gate/up ``weight``
    and ``x [M <= MAX_ROWS, K]`` (``scales``: as ``linear``)."""
    return _launch(x, weight, gated=True, scales=scales)


def normed_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, gated: bool, scales: BlockScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``kernels.normed_linear`` (no bias) for ``x [M <= MAX_ROWS, K]``: the
    projection (``gated``: its SwiGLU product) of the RMS-normed ``x + residual``, and
    ``x + residual`` as a new tensor (``x`` itself without a residual); ``scales``: as
    ``linear``."""
    if residual is None:
        return _launch(x, weight, gated, norm_weight, eps, scales=scales), x
    residual_out = torch.empty_like(x)
    return (_launch(x, weight, gated, norm_weight, eps, residual, residual_out, scales),
            residual_out)
