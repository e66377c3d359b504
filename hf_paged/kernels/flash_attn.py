"""The ``flash_attn`` attention backend: flash-attn's varlen kernel reading the paged cache
through its ``block_table`` argument. Used only when the flash-attn package imports (it is
never required); flash-attn 2 takes pages of a multiple of 256 tokens, so the engine asks for
``block_size=256`` with this backend.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

PAGE_MULTIPLE = 256


@functools.cache
def _varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    """Whether the flash-attn package imports (an install may be broken)."""
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return False
    return True


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
) -> torch.Tensor:
    """``reference.paged_attention`` through flash-attn. Its causal mask is aligned to the
    bottom right, as ours: query ``i`` of ``q`` new tokens sees keys up to
    ``seq_len - q + i``. The longest context is bounded by the block-table width (a bound is
    all flash-attn needs), so nothing here waits for the device."""
    if k_cache.dtype != query.dtype:
        raise ValueError(f"attention_backend 'flash_attn' reads no {k_cache.dtype} KV cache "
                         "(kv_cache_dtype 'auto' only)")
    cu_seqlens_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return _varlen_func()(
        query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
        max_query_len, block_tables.shape[1] * k_cache.shape[1],
        softmax_scale=scale, causal=True, block_table=block_tables,
    )
