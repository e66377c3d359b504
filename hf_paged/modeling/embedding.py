"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_paged.modeling.linear import tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; the others' rows add zeros."""

    def __init__(self, vocab_size: int, hidden_size: int, tp=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp or tp_rank_and_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        rows = min(self.shard_size, vocab_size - self.vocab_start)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, param.shape[0]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        y = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None]
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to full width."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        # Shards are padded to one size for the gather, then the padding is cut off.
        logits = F.pad(logits, (0, self.shard_size - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, -1)[..., : self.vocab_size]
