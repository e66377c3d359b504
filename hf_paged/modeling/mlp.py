"""Qwen3's SwiGLU feed-forward block with the gate and up projections merged."""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.modeling.linear import MergedColumnParallelLinear, RowParallelLinear
from hf_paged.modeling.tp import SINGLE, TensorParallel


class Qwen3PagedMLP(nn.Module):
    def __init__(self, config, tp: TensorParallel = SINGLE):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(x, residual)``, and the new residual stream."""
        # gate_up's small_m_rows were measured for the gated kernel
        act, residual = self.gate_up_proj.normed(x, residual, norm, gated=True)
        return self.down_proj(act), residual
