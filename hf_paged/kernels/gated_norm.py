"""The gated RMSNorm of the Gated DeltaNet layers' output (Qwen3-Next, Qwen3.5): RMSNorm of
the attention output times the SiLU of its gate, per row of ``[..., D]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.rmsnorm import norm_rows, normed, row_block, row_view


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, weight_ptr, out_ptr,
    heads, x_s0, x_s1, z_s0, z_s1, o_s0, o_s1, dim, eps,
    count, ROUND_SCALED: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    i, j, cols, mask = norm_rows(count, heads, dim, ROWS, BLOCK_D)
    x = tl.load(x_ptr + i * x_s0 + j * x_s1 + cols, mask=mask, other=0.0)
    z = tl.load(z_ptr + i * z_s0 + j * z_s1 + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    # transformers' casts: the normed row back to x's dtype, the weight's product in the two
    # dtypes' promotion (rounded unless that is float32), the gate's product in float32.
    scaled = normed(x, dim, eps) * weight
    if ROUND_SCALED:
        scaled = scaled.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + i * o_s0 + j * o_s1 + cols, scaled * (z / (1.0 + tl.exp(-z))), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """Triton twin of ``reference.gated_rms_norm``; ``x`` and ``z`` may be strided
    ``[T, H, D]`` views."""
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z {tuple(z.shape)} is not x's {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, z3, o3 = row_view(x), row_view(z), row_view(out)
    if x3.stride(-1) != 1 or z3.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gated_rms_norm: x, z and weight need a contiguous last dimension")
    rows, heads, dim = x3.shape
    if rows * heads == 0:
        return out
    block_d, block_rows, num_warps = row_block(dim)
    launch(
        _gated_rms_norm_kernel, (triton.cdiv(rows * heads, block_rows),),
        x3, z3, weight, o3,
        heads, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        o3.stride(0), o3.stride(1), dim, eps, rows * heads,
        ROUND_SCALED=torch.promote_types(x.dtype, weight.dtype) != torch.float32,
        ROWS=block_rows, BLOCK_D=block_d, num_warps=num_warps, **pdl_options(x),
    )
    return out
