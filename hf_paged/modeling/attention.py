"""What every paged attention layer reads: this step's metadata, and the attention
implementation of the engine's backend. The layers themselves are their family's
(``hf_paged.families``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.kernels import reference


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (see ``kernels.reference``).

    ``slot_mapping [T]``: cache slot of each new token (-1: padding, not stored).
    ``cu_seqlens_q [B+1]``: query rows of each sequence. ``seq_lens [B]``: context length of
    each sequence after this step. ``block_tables [B, max_blocks]``: cache blocks per sequence.
    ``max_query_len``: longest query run in the batch (1 when decoding).
    ``shared_prefix [1]``: a decode hint, set when every sequence's context starts with the
    same blocks: how many tokens they hold (cascade attention; see ``kernels.attention``).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    shared_prefix: torch.Tensor | None = None


def attention_function(backend: str):
    """The paged attention implementation of a backend, all with reference's signature plus
    the hints ``max_query_len`` and ``shared_prefix``."""
    if backend == "sdpa":
        return lambda *args, max_query_len, shared_prefix=None: reference.paged_attention(*args)
    if backend == "triton":
        from hf_paged.kernels.attention import paged_attention

        return paged_attention
    if backend == "flash_attn":
        from hf_paged.kernels.flash_attn import paged_attention

        return lambda *args, shared_prefix=None, **hints: paged_attention(*args, **hints)
    raise ValueError(f"attention_backend {backend!r} is not available")
