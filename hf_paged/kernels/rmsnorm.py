"""RMSNorm, with an optional fused residual add, over the last dimension of ``[..., D]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch

# Elements a program normalises: per-head norms (D = 128) have hundreds of thousands of rows
# in a long prefill, far too many programs at one row each, so a program takes a block of rows.
_TILE = 2048


def row_block(dim: int) -> tuple[int, int, int]:
    """``(BLOCK_D, ROWS, num_warps)`` for rows of ``dim`` elements: ``ROWS`` rows a program,
    about ``_TILE`` elements together (one row from 2,048 columns on), eight per thread."""
    block_d = triton.next_power_of_2(dim)
    rows = max(1, _TILE // block_d)
    return block_d, rows, max(1, min(8, rows * block_d // 256))


@triton.jit
def norm_rows(count, heads, dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``ROWS`` rows of a ``[rows, heads, D]`` view as a ``[ROWS, BLOCK_D]``
    tile, its ``count`` (row, head) pairs numbered ``row * heads + head`` (per-head norms read
    strided views of a fused projection without a copy): ``(i, j, columns, mask)``, the
    row and head indices ``[ROWS, 1]``, the columns ``[1, BLOCK_D]``."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    return (r // heads).to(tl.int64), r % heads, cols, (r < count) & (cols < dim)


@triton.jit
def normed(x, dim, eps):
    """Each row of the tile ``x`` times its inverse RMS in float32, cast back to ``x``'s dtype
    as transformers does before scaling (the product is rounded once more), as float32."""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=-1, keep_dims=True) / dim + eps)
    return (xf * inv_rms).to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    heads, x_s0, x_s1, r_s0, r_s1, o_s0, o_s1, dim, eps,
    count, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    i, j, cols, mask = norm_rows(count, heads, dim, ROWS, BLOCK_D)
    x = tl.load(x_ptr + i * x_s0 + j * x_s1 + cols, mask=mask, other=0.0)
    # Loaded before the reduction, not after: its latency overlaps instead of adding up.
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + i * r_s0 + j * r_s1 + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as the reference's plain ``x + residual``.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptrs, x, mask=mask)
    if OFFSET:  # zero-centred: the float32 row times 1 + weight, rounded once at the store
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=-1, keep_dims=True) / dim + eps)
        out = xf * inv_rms * (1.0 + weight)
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
    block_d, block_rows, num_warps = row_block(dim)
    launch(
        _rms_norm_kernel, (triton.cdiv(rows * heads, block_rows),),
        x3, r3, weight, o3,
        heads, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), dim, eps, rows * heads,
        HAS_RESIDUAL=residual is not None, OFFSET=offset, ROWS=block_rows, BLOCK_D=block_d,
        num_warps=num_warps, **pdl_options(x),
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
