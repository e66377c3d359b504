"""Copy-on-write block copies of the paged KV cache, all of a step's in one launch a layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.launch import launch

_BLOCK = 1024


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, block_numel, BLOCK: tl.constexpr):
    # Program (pair, chunk) copies one chunk of one block, of the K and of the V cache.
    pair = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    src = tl.load(src_ptr + pair).to(tl.int64) * block_numel + offsets
    dst = tl.load(dst_ptr + pair).to(tl.int64) * block_numel + offsets
    tl.store(k_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Triton twin of ``reference.copy_blocks``."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    block_numel = k_cache[0].numel()
    if src.numel():
        grid = (src.numel(), triton.cdiv(block_numel, _BLOCK))
        launch(_copy_blocks_kernel, grid, k_cache, v_cache, src, dst, block_numel, BLOCK=_BLOCK)
