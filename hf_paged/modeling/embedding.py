"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged import kernels
from hf_paged.modeling.linear import narrow
from hf_paged.modeling.tp import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; the others' rows add zeros."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        rows = max(min(self.shard_size, vocab_size - self.vocab_start), 0)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data.copy_(narrow(loaded, 0, self.vocab_start, param.shape[0]))

    def forward(self, input_ids: torch.Tensor, src: torch.Tensor | None = None,
                last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of ``input_ids``, or where ``src >= 0`` of the pending token
        ``last_tokens[src]`` (``kernels.embed``)."""
        flat = input_ids.reshape(-1)  # clients may pass [batch, length]
        src = None if src is None else src.reshape(-1)
        rows = kernels.embed(flat, self.weight, self.vocab_start, src, last_tokens)
        rows = rows.view(*input_ids.shape, rows.shape[-1])
        return rows if self.tp.size == 1 else self.tp.all_reduce(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice (padded to the common shard width);
    ``gather`` puts the full vocabulary together on rank 0."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__(vocab_size, hidden_size, tp)
        self.small_m_rows = 0  # up to how many rows the small-M kernel serves (start-up's choice)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = kernels.linear(hidden, self.weight, small_m_rows=self.small_m_rows)
        if self.tp.size == 1:
            return logits
        return F.pad(logits, (0, self.shard_size - logits.shape[-1]))

    def gather(self, local_logits: torch.Tensor, everywhere: bool = False
               ) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0, None on the other ranks (``everywhere``: on every
        rank)."""
        logits = self.tp.gather_last_dim(local_logits, everywhere)
        return None if logits is None else logits[..., : self.vocab_size]
