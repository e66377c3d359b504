"""A sparse mixture-of-experts block: a top-k router and every expert's SwiGLU feed-forward, in
transformers' parameter layout (``gate.weight``, ``experts.gate_up_proj``,
``experts.down_proj``), run by the fused kernels.

Under tensor parallelism every rank holds every expert's slice of ``moe_intermediate_size``
(its rows of gate and of up, its columns of down) and the router whole; the block's output is
a partial sum, all-reduced once as the dense MLP's down projection is.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.modeling.linear import divide, narrow
from hf_paged.modeling.tp import SINGLE, TensorParallel


class Router(nn.Module):
    """The router's ``[num_experts, hidden]`` matrix, replicated on every rank."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class PagedExperts(nn.Module):
    """Every expert's weights as transformers 5 stores them: ``gate_up_proj``
    ``[E, 2 * I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``, ``I`` being
    this rank's slice of the intermediate size.

    ``weight_loader`` fills them from either checkpoint layout: the fused 3-D tensors
    (``shard_id`` None) or one expert's ``gate_proj``/``up_proj``/``down_proj`` matrix
    (``shard_id`` = ``(expert, part)``, part 0 gate, 1 up, None down)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.intermediate = divide(intermediate, tp.size, "moe_intermediate_size")
        local = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local),
                                      requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded,
                      shard_id: tuple[int, int | None] | None = None) -> None:
        local, start = self.intermediate, self.tp.rank * self.intermediate
        if param is self.down_proj:  # this rank's columns
            if shard_id is None:
                param.data.copy_(narrow(loaded, 2, start, local))
            else:
                param.data[shard_id[0]].copy_(narrow(loaded, 1, start, local))
            return
        if shard_id is None:  # [E, 2 * I_full, H]: this rank's gate rows, then its up rows
            full = local * self.tp.size
            for part in (0, 1):
                param.data.narrow(1, part * local, local).copy_(
                    narrow(loaded, 1, part * full + start, local))
            return
        expert, part = shard_id
        param.data[expert].narrow(0, part * local, local).copy_(narrow(loaded, 0, start, local))


class SparseMoEBlock(nn.Module):
    """Router, top-k routing and the experts; transformers' ``Qwen3MoeSparseMoeBlock`` in
    numbers: float32 softmax over the router's logits, the ``top_k`` largest, renormalised
    when ``norm_topk_prob``, cast to the model dtype, each expert's output weighted by its
    routing weight and the ``top_k`` outputs summed."""

    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool, hidden: int,
                 intermediate: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.top_k, self.norm_topk_prob = tp, top_k, norm_topk_prob
        self.gate = Router(num_experts, hidden)
        self.experts = PagedExperts(num_experts, hidden, intermediate, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(x, residual)``, and the new residual stream."""
        x, residual = norm(x, residual)
        logits = kernels.linear(x, self.gate.weight)
        weights, ids = kernels.moe_route(logits, self.top_k, self.norm_topk_prob)
        out = kernels.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj,
                                  weights, ids)
        return self.tp.all_reduce(out), residual
