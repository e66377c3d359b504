"""A transformers-style forward over padded ``[batch, seq_len]`` tensors, through the swapped
modules, on a scratch KV cache of its own: scoring never touches the engine's cache.

transformers lets a query attend to the earlier keys that the attention mask keeps, with RoPE
at ``position_ids``. Packing each row's kept tokens into one sequence, at their own positions,
gives those same attention sets, so the paged prefill path computes it. Every layer runs over
all tokens before the next starts, so the layers share one scratch cache.
"""

from __future__ import annotations

import contextlib

import torch

from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.swap import PagedQwen3


@torch.no_grad()
def full_forward(
    model: PagedQwen3,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Final hidden states ``[batch, seq_len, hidden]``; rows the mask drops are zero."""
    device = model.embed_tokens.weight.device
    batch, width = input_ids.shape
    keep = attention_mask.to(device).bool()
    kept = keep.flatten().nonzero().squeeze(1)  # row-major: grouped by row, in order
    lengths = keep.sum(1)
    lengths = lengths[lengths > 0]
    hidden_size = model.config.hidden_size
    out = torch.zeros(batch * width, hidden_size, dtype=model.embed_tokens.weight.dtype,
                      device=device)
    if kept.numel() == 0:
        return out.view(batch, width, hidden_size)
    blocks = (lengths + block_size - 1) // block_size
    first_block = torch.cumsum(blocks, 0) - blocks
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    index_in_row = torch.arange(kept.numel(), device=device) - cu_seqlens[row]
    num_blocks = int(blocks.sum())
    table = first_block[:, None] + torch.arange(int(blocks.max()), device=device)
    meta = AttentionMetadata(
        slot_mapping=first_block[row] * block_size + index_in_row,
        cu_seqlens_q=cu_seqlens.to(torch.int32),
        seq_lens=lengths.to(torch.int32),
        block_tables=table.clamp(max=num_blocks - 1).to(torch.int32),
        max_query_len=int(lengths.max()),
    )
    tokens = input_ids.to(device).flatten()[kept]
    positions = position_ids.to(device).expand(batch, width).flatten()[kept]
    with _scratch_cache(model, num_blocks, block_size):
        out[kept] = model.forward(tokens, positions, meta)
    return out.view(batch, width, hidden_size)


@contextlib.contextmanager
def _scratch_cache(model: PagedQwen3, num_blocks: int, block_size: int):
    """Point every attention layer at one fresh cache, then back at the engine's."""
    layers = model.attention_layers
    weight = model.embed_tokens.weight
    shape = (num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    k, v = (torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in "kv")
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    try:
        for layer in layers:
            layer.k_cache, layer.v_cache = k, v
        yield
    finally:
        for layer, (k_cache, v_cache) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k_cache, v_cache
