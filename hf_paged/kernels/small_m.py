"""Projections of a few rows (decode at batch sizes up to ``MAX_ROWS``): ``x [M, K] @ W.T``.

At batch 1 a projection reads its whole weight matrix for one row of output, so it is bound by
memory bandwidth, and cuBLAS's small-M GEMMs reached about 45% of it on the H100 for
Qwen3-0.6B's matrices (4 to 12 MiB each). Here each program streams a ``BLOCK_N``-row strip of
the weight through a pipelined loop over K and multiplies it with all M rows of ``x`` (padded
to 16 for the tensor cores, which are otherwise idle). The gated form also computes the
SwiGLU product of the merged gate/up projection in the same pass, so the MLP's activation needs
no kernel of its own: a program takes row strip ``n`` of the gate half and the same strip of
the up half, and rounds as ``silu_and_mul`` over the rounded projection does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 16, 256


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, x_s0, w_s0, out_s0, gate_offset,
    GATED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * x_s0 + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_s0 + ks[None, :]
    row_ok, col_ok = rows[:, None] < M, cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks[None, :] < K - k
        x = tl.load(x_ptrs + k, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs + k, mask=col_ok & k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + gate_offset * w_s0 + k, mask=col_ok & k_ok, other=0.0)
            up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        # Rounded as the unfused path: the projection to the model dtype, then silu, then the
        # product.
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * up.to(out_ty).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * out_s0 + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch(x: torch.Tensor, weight: torch.Tensor, n: int, gated: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == weight.stride(1) == 1
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _small_m_kernel[(triton.cdiv(n, _BLOCK_N),)](
            x, weight, out, x.shape[0], n, x.shape[1], x.stride(0), weight.stride(0),
            out.stride(0), n, GATED=gated,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=4,
        )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.linear`` (no bias) for ``x [M <= MAX_ROWS, K]``."""
    return _launch(x, weight, weight.shape[0], gated=False)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.gated_linear`` for ``x [M <= MAX_ROWS, K]``."""
    return _launch(x, weight, weight.shape[0] // 2, gated=True)
