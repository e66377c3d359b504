"""A transformers-style forward over padded ``[batch, seq_len]`` tensors, through the swapped
modules, on a scratch KV cache of its own: scoring never touches the engine's cache.

transformers (SDPA attention) lets every query attend to the earlier keys that the attention
mask keeps, with RoPE at ``position_ids``. Packing each row's kept tokens into one sequence,
at their own positions, gives those attention sets, so the paged prefill path computes them.
A dropped token still gets an output: it attends to the kept keys before it (never to its
own), so it runs as a one-token sequence over the first ``c`` keys of its row, storing
nothing; with ``c == 0`` SDPA's attention output is zero, which a context of one all-zero
block (key and value zero) reproduces. Every layer runs over all tokens before the next one
starts, so the layers share one scratch cache.

A hybrid model's linear-attention layers run as transformers' do: each row whole, padding
included, as one sequence from a zero state, the padding's input to the layer zeroed
(``PaddedRows``); row ``r`` runs in state slot ``r``, so the caller points their pools at
scratch ones of ``batch`` slots (``worker.state_cache.StateCache.scratch``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hf_paged.kernels.lora_tiles import LoraTiles
from hf_paged.modeling.attention import AttentionMetadata, PaddedRows
from hf_paged.modeling.lora import LoraBatch
from hf_paged.modeling.paged_model import PagedModel


@torch.no_grad()
def full_forward(
    model: PagedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    block_size: int,
    lora: tuple[LoraBatch, list[int]] | None = None,
    streams: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Final hidden states ``[batch, seq_len, hidden]``, as transformers' model computes them;
    ``lora``: the model's adapter batch and each row's adapter slot (-1: none). ``streams``:
    transformers' ``hidden_states`` instead, every layer's input and the final ones."""
    device = model.embed_tokens.weight.device
    batch, width = input_ids.shape
    keep = attention_mask.to(device).bool()
    arange = torch.arange(batch * width, device=device)
    kept, dropped = arange[keep.flatten()], arange[~keep.flatten()]  # row-major order
    # Kept tokens: one sequence per row, in blocks of their own; block `zero` stays empty.
    lengths = keep.sum(1)
    blocks = (lengths + block_size - 1) // block_size
    first_block = torch.cumsum(blocks, 0) - blocks
    zero = int(blocks.sum())
    row_blocks = first_block[:, None] + torch.arange(max(int(blocks.max()), 1), device=device)
    row_of_kept = kept // width
    index_in_row = torch.cumsum(keep, 1).flatten()[kept] - 1
    # Dropped tokens: one-token sequences over the kept keys before them (or the zero block).
    before = torch.cumsum(keep, 1).flatten()[dropped]
    row_of_dropped = dropped // width
    dropped_tables = torch.where(before[:, None] > 0, row_blocks[row_of_dropped], zero)
    kept_lengths = lengths[lengths > 0]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([first_block[row_of_kept] * block_size + index_in_row,
                                torch.full_like(dropped, -1)]),
        cu_seqlens_q=F.pad(torch.cat([kept_lengths, torch.ones_like(dropped)]).cumsum(0),
                           (1, 0)).to(torch.int32),
        seq_lens=torch.cat([kept_lengths, before.clamp(min=1)]).to(torch.int32),
        block_tables=torch.cat([row_blocks[lengths > 0], dropped_tables]).clamp(max=zero)
        .to(torch.int32),
        max_query_len=max(int(lengths.max()), 1),
    )
    order = torch.cat([kept, dropped])
    if model.state_modules:
        meta.padded_rows = _padded_rows(order, keep, model.embed_tokens.weight.dtype)
    tokens = input_ids.to(device, torch.long).flatten()[order]
    positions = position_ids.to(device, torch.long).expand(batch, width).flatten()[order]
    collected = [] if streams else None
    with _scratch_cache(model, zero + 1, block_size), _adapter_rows(
            lora, meta, lengths, row_of_dropped, device):
        final = model.forward(tokens, positions, meta, streams=collected)
    unpacked = []
    for packed in collected or [final]:
        out = torch.empty(batch * width, packed.shape[-1], dtype=packed.dtype, device=device)
        out[order] = packed
        unpacked.append(out.view(batch, width, -1))
    return tuple(unpacked) if streams else unpacked[0]


def _padded_rows(order: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> PaddedRows:
    """The rows of ``keep [batch, width]`` for the linear-attention layers; ``order``: the
    row-major position of each packed token."""
    (batch, width), device = keep.shape, keep.device
    to_rows = torch.empty_like(order)
    to_rows[order] = torch.arange(order.numel(), device=device)
    # transformers' create_recurrent_attention_mask: no mask for one token or a mask of ones
    zeroed = width > 1 and not bool(keep.all())
    full = torch.full((batch,), width, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full_like(order, -1),
        cu_seqlens_q=F.pad(full.cumsum(0, dtype=torch.int32), (1, 0)),
        seq_lens=full,
        block_tables=torch.zeros(batch, 1, dtype=torch.int32, device=device),
        max_query_len=width,
        state_slots=torch.arange(batch, dtype=torch.int32, device=device),
        has_initial_state=torch.zeros(batch, dtype=torch.bool, device=device),
    )
    return PaddedRows(to_rows, order, keep.flatten()[:, None].to(dtype) if zeroed else None,
                      meta)


@contextlib.contextmanager
def _adapter_rows(lora: tuple[LoraBatch, list[int]] | None, meta: AttentionMetadata,
                  lengths: torch.Tensor, row_of_dropped: torch.Tensor, device: torch.device):
    """Each packed sequence on its row's adapter slot while the forward runs."""
    if lora is None or all(s < 0 for s in lora[1]):
        yield
        return
    batch, row_slots = lora
    row_slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
    slots = torch.cat([row_slots[lengths > 0], row_slots[row_of_dropped]])
    batch.rows = LoraTiles.build(meta.cu_seqlens_q.diff().tolist(), slots.tolist(), device)
    try:
        yield
    finally:
        batch.rows = None


@contextlib.contextmanager
def _scratch_cache(model: PagedModel, num_blocks: int, block_size: int):
    """Point every attention layer at one fresh, zeroed cache of the engine's cache dtype (an
    FP8 one scores as generation computes), then back at the engine's."""
    layers = model.attention_layers
    weight = model.embed_tokens.weight
    shape = (num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    k, v = (torch.zeros(shape, dtype=layers[0].k_cache.dtype, device=weight.device)
            for _ in "kv")
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    try:
        for layer in layers:
            layer.k_cache, layer.v_cache = k, v
        yield
    finally:
        for layer, (k_cache, v_cache) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k_cache, v_cache
