"""RMSNorm, with an optional fused residual add, over the last dimension of ``[..., D]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch


@triton.jit
def norm_row(heads, dim, BLOCK_D: tl.constexpr):
    """This program's row of a ``[rows, heads, D]`` view, one program a row (per-head norms
    read strided views of a fused projection without a copy): ``(i, j, columns, mask)``."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    return (row // heads).to(tl.int64), row % heads, cols, cols < dim


@triton.jit
def normed(x, dim, eps):
    """``x`` (a row) times its inverse RMS in float32, cast back to ``x``'s dtype as
    transformers does before scaling (the product is rounded once more), as float32."""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    return (xf * inv_rms).to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    heads, x_s0, x_s1, r_s0, r_s1, o_s0, o_s1, dim, eps,
    HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    i, j, cols, mask = norm_row(heads, dim, BLOCK_D)
    x = tl.load(x_ptr + i * x_s0 + j * x_s1 + cols, mask=mask, other=0.0)
    # Loaded before the reduction, not after: its latency overlaps instead of adding up.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + i * r_s0 + j * r_s1 + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as the reference's plain ``x + residual``.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptrs, x, mask=mask)
    if OFFSET:  # zero-centred: the float32 row times 1 + weight, rounded once at the store
        xf = x.to(tl.float32)
        out = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps) * (1.0 + weight)
    else:
        out = normed(x, dim, eps) * weight
    tl.store(out_ptr + i * o_s0 + j * o_s1 + cols, out, mask=mask)


def row_view(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` as a ``[rows, heads, D]`` view (leading dims beyond two are flattened)."""
    if x.dim() == 1:
        return x[None, None]
    return x[:, None] if x.dim() == 2 else x.flatten(0, -3)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, eps: float, offset: bool) -> None:
    x3, o3 = row_view(x), row_view(out)
    r3 = x3 if residual is None else row_view(residual)
    assert x3.stride(-1) == r3.stride(-1) == o3.stride(-1) == weight.stride(-1) == 1
    rows, heads, dim = x3.shape
    if rows * heads == 0:
        return
    block_d = triton.next_power_of_2(dim)
    launch(
        _rms_norm_kernel, (rows * heads,),
        x3, r3, weight, o3,
        heads, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), dim, eps,
        HAS_RESIDUAL=residual is not None, OFFSET=offset, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_d // 256)), **pdl_options(x),
    )


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, offset: bool) -> torch.dtype:
    """The reference's output dtype: the zero-centred norm casts to ``x``'s."""
    return x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
             ) -> torch.Tensor:
    """Triton twin of ``reference.rms_norm``; ``x`` may be a strided ``[T, H, D]`` view."""
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, offset), device=x.device)
    _launch(x, None, weight, out, eps, offset)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.add_rms_norm``, in place: ``residual <- x + residual`` and
    ``x <- rms_norm(residual)``; returns ``(x, residual)``.

    Should ``weight`` have a wider dtype than ``x``, the normed output gets a new tensor of that
    dtype, as in the reference, rather than being rounded into ``x``.
    """
    out_dtype = _out_dtype(x, weight, offset)
    out = x if out_dtype == x.dtype else torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, residual, weight, out, eps, offset)
    return out, residual
