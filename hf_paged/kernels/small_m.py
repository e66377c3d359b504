"""Projections of a few rows (decode at small batches): ``x [M, K] @ W.T`` for M up to
``MAX_ROWS``.

At batch 1 a projection reads its whole weight for one row of output: it is bound by memory
latency and bandwidth, and cuBLAS's kernels for it are not (on an H200, inside CUDA graphs,
over the 28 layers' weights of Qwen3-0.6B: qkv 5.2 us against this kernel's 4.1, o_proj 12.6
against 3.3, gate/up 6.0 against 5.1, down 6.5 against 4.0; the tensor-core tiles this kernel
used before, 16 weight rows by 256, lost to cuBLAS on all but o_proj). So a program reads a
strip of ``BLOCK_N`` weight rows (2 or 4) across up to 1,024 columns at a time, as wide
16-byte loads, multiplies it elementwise with one row of ``x`` and reduces along K: many
small programs keep the whole weight in flight at once. Row ``m`` of ``x`` is
``program_id(1)``: a second row's programs read the strip from L2, not from memory. The
merged gate/up projection can produce its SwiGLU product in the same pass (``gated_linear``),
which saves the activation's launch. Start-up
still measures both kernels per projection shape (``worker/projection_tuning.py``) and uses
this one only where it wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.launch import launch

MAX_ROWS = 8
_MAX_BLOCK_K = 1024


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, out_ptr, N, K, x_s0, w_s0, out_s0,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
):
    # GATED: the weight is [gate; up] (2N rows) and the output silu(x @ gate.T) * (x @ up.T),
    # each product rounded to the output dtype first, as silu_and_mul(F.linear(x, w)).
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols[:, None] < N
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_s0 + ks[None, :]
    x_ptrs = x_ptr + row * x_s0 + ks
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:  # no masks: the loads stay 16 bytes wide
            x = tl.load(x_ptrs + k).to(tl.float32)
            w = tl.load(w_ptrs + k).to(tl.float32)
            if GATED:
                u = tl.load(w_ptrs + N * w_s0 + k).to(tl.float32)
        else:
            k_ok = ks < K - k
            x = tl.load(x_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k, mask=col_ok & k_ok[None, :], other=0.0).to(tl.float32)
            if GATED:
                u = tl.load(w_ptrs + N * w_s0 + k, mask=col_ok & k_ok[None, :],
                            other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        if GATED:
            up += tl.sum(u * x[None, :], axis=1)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_s0 + cols, acc.to(dtype), mask=cols < N)


def _launch(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == weight.stride(1) == 1
    n, k = weight.shape
    n //= 1 + gated
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block_n = 4 if n >= 4096 else 2  # narrow outputs: more, smaller programs
        block_k = min(_MAX_BLOCK_K, triton.next_power_of_2(k))
        launch(
            _small_m_kernel, (triton.cdiv(n, block_n), x.shape[0]),
            x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN=n % block_n == 0 and k % block_k == 0,
            GATED=gated, num_warps=4, num_stages=1,
        )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``F.linear`` (no bias) for ``x [M <= MAX_ROWS, K]``."""
    return _launch(x, weight, gated=False)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``silu_and_mul(F.linear(x, weight))`` for a merged gate/up ``weight``
    and ``x [M <= MAX_ROWS, K]``."""
    return _launch(x, weight, gated=True)
