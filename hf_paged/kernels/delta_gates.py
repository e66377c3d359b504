"""The Gated DeltaNet layers' per-token gates in one launch (twin:
``reference_gated_delta.gated_delta_gates``): the log decay ``g`` and the write strength
``beta`` of every (token, value head), where transformers' expression takes eight elementwise
kernels a layer (casts, exp, softplus, sigmoid), each a launch of its own in a decode step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_gated_delta import check_gates

_BLOCK = 1024  # (token, head) pairs a program
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's softplus: x itself above it


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, pairs, heads,
                  a_s0, b_s0, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < pairs
    row, head = (idx // heads).to(tl.int64), idx % heads
    a = tl.load(a_ptr + row * a_s0 + head, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * b_s0 + head, mask=ok, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + head, mask=ok, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + head, mask=ok, other=0.0).to(tl.float32)
    softplus = tl.where(x > _SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(x)))
    tl.store(g_ptr + idx, -tl.exp(a_log) * softplus, mask=ok)
    # sigmoid in float32, rounded once to b's dtype, as torch's half-precision sigmoid
    tl.store(beta_ptr + idx, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=ok)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.gated_delta_gates``; ``a`` and ``b`` may be row-strided
    views of a fused projection."""
    check_gates(a, b, a_log, dt_bias)
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("gated_delta_gates: a and b need a contiguous last dimension")
    rows, heads = a.shape
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, heads, dtype=b.dtype, device=a.device)
    if rows * heads:
        launch(_gates_kernel, (triton.cdiv(rows * heads, _BLOCK),), a, b, a_log, dt_bias, g,
               beta, rows * heads, heads, a.stride(0), b.stride(0), BLOCK=_BLOCK,
               **pdl_options(a))
    return g, beta
