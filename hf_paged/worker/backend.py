"""Which attention backend a device runs: the one asked for if it can, else a clear error."""

from __future__ import annotations

import torch

from hf_paged.kernels import triton_available, triton_on
from hf_paged.kernels.flash_attn import PAGE_MULTIPLE, flash_attn_available


def resolve_backend(backend: str | None, device: torch.device, block_size: int) -> str:
    """``backend`` (None: Triton on CUDA when it imports, else torch's SDPA) if ``device``
    and ``block_size`` allow it."""
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if backend == "triton" and not triton_on(device):
        raise ValueError("attention_backend 'triton' needs a CUDA device and the triton package")
    if backend == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError(
                "attention_backend 'flash_attn' needs a CUDA device and the flash-attn package"
            )
        if block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"attention_backend 'flash_attn' needs block_size {PAGE_MULTIPLE} (flash-attn's "
                f"paged cache takes pages of a multiple of {PAGE_MULTIPLE}), got {block_size}"
            )
    return backend

