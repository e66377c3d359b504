"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels


class RMSNorm(nn.Module):
    """transformers' Qwen3RMSNorm (``offset``: the zero-centred Qwen3NextRMSNorm, its weight
    stored as an offset from one); ``forward(x, residual)`` also does the residual add.

    With a residual it returns ``(rms_norm(x + residual), x + residual)``, the pair the next
    block needs, in one pass over the activations.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps, offset=self.offset)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset)
