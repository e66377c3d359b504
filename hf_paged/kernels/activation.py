"""SiLU-gated product of the merged gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_s0, out_s0, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_s0 + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_s0 + inter + cols, mask=mask).to(tl.float32)
    # silu is rounded to the input dtype before the product, as ``F.silu(gate) * up``.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_s0 + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.silu_and_mul`` for ``x [..., 2I]``."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
        launch(_silu_and_mul_kernel, grid, x2, out, x2.stride(0), out.stride(0), inter,
               BLOCK=_BLOCK, **pdl_options(x))
    return out.view(*x.shape[:-1], inter)
