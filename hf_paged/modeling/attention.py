"""What every paged attention layer reads: this step's metadata, and the attention
implementation of the engine's backend. The layers themselves are their family's
(``hf_paged.families``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    ``decode_order [B]``: a decode hint, the sequences longest context first (``decode_order``).
    A hybrid model's linear-attention layers (None for other models): ``state_slots [B]``
    int32, each sequence's slot of the state pools (-1: a CUDA-graph padding row);
    ``has_initial_state [B]`` bool, whether the slot holds the state after the sequence's
    tokens before this step (False: it starts from zeros, its first chunk or a recompute).
    ``padded_rows``: the model call's rows as the linear-attention layers read them
    (``PaddedRows``; None in the engine's steps).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    shared_prefix: torch.Tensor | None = None
    decode_order: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    padded_rows: PaddedRows | None = None


@dataclass
class PaddedRows:
    """The model call's padded ``[batch, width]`` rows (``modeling.full_forward``) as a
    linear-attention layer reads them. transformers runs each row whole, padding included,
    from a zero state, and zeroes the padding's input to the layer
    (``apply_mask_to_padding_states``); the attention layers' packing orders the tokens apart.

    ``to_rows [batch * width]``: the packed token at each row-major position; ``to_packed``:
    the row-major position of each packed token; ``keep [batch * width, 1]``: 1 for a token
    the mask keeps, 0 for padding, in the model dtype (None: nothing is zeroed, as
    transformers skips the mask for a width of one or a mask of ones); ``meta``: each row as
    one sequence starting from zeros in state slot ``row`` (``state_slots``,
    ``has_initial_state``), storing nothing in the KV cache.
    """

    to_rows: torch.Tensor
    to_packed: torch.Tensor
    keep: torch.Tensor | None
    meta: AttentionMetadata

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``x [T, ...]`` in row-major order, the padding zeroed."""
        x = x[self.to_rows]
        return x if self.keep is None else x * self.keep

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Row-major ``x`` back in the packed order."""
        return x[self.to_packed]


def decode_order(seq_lens: Sequence[int]) -> np.ndarray:
    """The order in which decode attention should start its sequences' programs: longest
    context first, so that the last to start are short and the GPU does not end a step on a
    long one alone (longest-processing-time-first scheduling)."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int32), kind="stable").astype(np.int32)


def attention_function(backend: str):
    """The paged attention implementation of a backend, all with reference's signature plus
    the hints ``max_query_len``, ``shared_prefix`` and ``order`` (and an FP8 cache's
    ``k_scale`` / ``v_scale``)."""
    if backend == "sdpa":
        return lambda *args, max_query_len, shared_prefix=None, order=None, **scales: (
            reference.paged_attention(*args, **scales))
    if backend == "triton":
        from hf_paged.kernels.attention import paged_attention

        return paged_attention
    if backend == "flash_attn":
        from hf_paged.kernels.flash_attn import paged_attention

        return lambda *args, shared_prefix=None, order=None, k_scale=None, v_scale=None, \
            **hints: paged_attention(*args, **hints)
    raise ValueError(f"attention_backend {backend!r} is not available")
