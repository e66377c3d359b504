"""A sparse mixture-of-experts block with a shared expert (Qwen3-Next, Qwen3.5-MoE):
transformers' ``Qwen3NextSparseMoeBlock`` in numbers. Every token goes through the routed
experts (``SparseMoEBlock``) and through the shared expert, a SwiGLU MLP scaled by
``sigmoid(shared_expert_gate(x))``; the two are summed.

Under tensor parallelism the shared expert is split as a dense MLP is, its gate replicated;
the routed and the shared shares are summed first and all-reduced once.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.modeling.moe import Router, SparseMoEBlock
from hf_paged.modeling.tp import SINGLE, TensorParallel


class SharedExpertMoEBlock(SparseMoEBlock):
    """``SparseMoEBlock`` plus ``shared_expert`` (a module with a merged ``gate_up_proj`` and a
    row-parallel ``down_proj``, as ``Qwen3PagedMLP``) and ``shared_expert_gate`` (``[1,
    hidden]``, replicated)."""

    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool, hidden: int,
                 intermediate: int, shared_expert: nn.Module, tp: TensorParallel = SINGLE):
        super().__init__(num_experts, top_k, norm_topk_prob, hidden, intermediate, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(1, hidden)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(x, residual)``, and the new residual stream."""
        x, residual = norm(x, residual)
        up = self.shared_expert.gate_up_proj
        shared = self.shared_expert.down_proj.partial(
            kernels.gated_linear(x, up.weight, up.small_m_rows, up.scales, up.w8a8_rows,
                                 up.cublas_rows, up.fp8_mma))
        gate = torch.sigmoid(kernels.linear(x, self.shared_expert_gate.weight))
        # transformers' order: the routed sum plus the gated shared expert, in the model dtype
        return self.tp.all_reduce(self.routed(x) + gate * shared), residual
