"""Projections of a few rows (decode at small batches): ``x [M, K] @ W.T`` for M up to
``MAX_ROWS``.

At batch 1 a projection reads its whole weight for one row of output, so it is bound by memory
latency and bandwidth, and cuBLAS's choice of kernel for some shapes is poor there: on an H200,
Qwen3-0.6B's o_proj (1024 x 2048) took 12.6 us at one row where this kernel takes 5.9. For
others cuBLAS is faster by 5-15%, so start-up measures both for each projection
(``worker/projection_tuning.py``) and uses this one only where it wins. Each program streams a
``BLOCK_N``-row strip of the weight through a pipelined loop over K and multiplies it with all
M rows of ``x`` (padded to 16 for the tensor cores, which are otherwise idle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.launch import launch

MAX_ROWS = 8
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 16, 256


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, x_s0, w_s0, out_s0,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * x_s0 + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_s0 + ks[None, :]
    row_ok, col_ok = rows[:, None] < M, cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks[None, :] < K - k
        x = tl.load(x_ptrs + k, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs + k, mask=col_ok & k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * out_s0 + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``F.linear`` (no bias) for ``x [M <= MAX_ROWS, K]``."""
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == weight.stride(1) == 1
    n = weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        launch(
            _small_m_kernel, (triton.cdiv(n, _BLOCK_N),),
            x, weight, out, x.shape[0], n, x.shape[1], x.stride(0), weight.stride(0),
            out.stride(0), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=4,
        )
    return out
