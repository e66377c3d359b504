"""A sparse mixture-of-experts block: a top-k router and every expert's SwiGLU feed-forward, in
transformers' parameter layout (``gate.weight``, ``experts.gate_up_proj``,
``experts.down_proj``), run by the fused kernels.

Under tensor parallelism every rank holds every expert's slice of ``moe_intermediate_size``
(its rows of gate and of up, its columns of down) and the router whole; the block's output is
a partial sum, all-reduced once as the dense MLP's down projection is. Under expert
parallelism (``TensorParallel.expert_parallel``) a rank holds a contiguous range of whole
experts instead and computes only the pairs routed to them (the others' ids become -1, which
the kernels skip); the activations are replicated as before, so the same all-reduce sums the
ranks' shares.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.kernels.block_scales import FP8, BlockScales, grid_rows, quantize
from hf_paged.modeling.linear import cdiv, divide, narrow
from hf_paged.modeling.tp import SINGLE, TensorParallel


class Router(nn.Module):
    """The router's ``[num_experts, hidden]`` matrix, replicated on every rank."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class PagedExperts(nn.Module):
    """Every expert's weights as transformers 5 stores them: ``gate_up_proj``
    ``[E, 2 * I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``, ``I`` being
    this rank's slice of the intermediate size; block-quantized (``hold_fp8``), each with its
    ``*_scale_inv`` grid, as transformers' ``FP8Experts`` names them (gate's and up's grids
    stacked).

    ``weight_loader`` fills them from either checkpoint layout: the fused 3-D tensors
    (``shard_id`` None) or one expert's ``gate_proj``/``up_proj``/``down_proj`` matrix
    (``shard_id`` = ``(expert, part)``, part 0 gate, 1 up, None down)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        if tp.expert_parallel:  # this rank's experts whole
            self.num_local = divide(num_experts, tp.size, "num_experts")
            self.first_expert, self.intermediate = tp.rank * self.num_local, intermediate
        else:  # every expert's slice
            self.num_local, self.first_expert = num_experts, 0
            self.intermediate = divide(intermediate, tp.size, "moe_intermediate_size")
        local = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * local, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, local),
                                      requires_grad=False)
        self.block: tuple[int, int] | None = None  # FP8: (rows, columns) a scale covers

    def hold_fp8(self, block: tuple[int, int]) -> None:
        """Hold both weights in float8_e4m3fn with their scale grids (on the meta device)."""
        (experts, hidden, local), (bn, bk) = self.down_proj.shape, block
        self.block = block
        for name, rows, cols, grid_rows_ in (("gate_up_proj", 2 * local, hidden,
                                              2 * cdiv(local, bn)),
                                             ("down_proj", hidden, local, cdiv(hidden, bn))):
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8),
                                             requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(
                torch.empty(experts, grid_rows_, cdiv(cols, bk)), requires_grad=False))
        self.register_buffer("gate_up_rows", torch.empty(2 * local, dtype=torch.int32),
                             persistent=False)
        self.register_buffer("down_rows", torch.empty(hidden, dtype=torch.int32),
                             persistent=False)

    def init_scale_rows(self) -> None:
        """Fill the grid row of each weight row, once the model is on its device."""
        bn = self.block[0]
        self.gate_up_rows.copy_(grid_rows([self.intermediate] * 2, bn, self.gate_up_rows.device))
        self.down_rows.copy_(grid_rows([self.down_proj.shape[1]], bn, self.down_rows.device))

    @property
    def scales(self) -> dict[str, BlockScales]:
        """The gate/up and down weights' block scales as ``kernels.moe_experts`` takes them
        (``w13_scales``, ``w2_scales``); none for float weights."""
        if self.block is None:
            return {}
        return dict(
            w13_scales=BlockScales(self.gate_up_proj_scale_inv, self.gate_up_rows, self.block[1]),
            w2_scales=BlockScales(self.down_proj_scale_inv, self.down_rows, self.block[1]))

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts' ``ids`` as this rank holds them: -1 for another rank's."""
        if not self.tp.expert_parallel:
            return ids
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < self.num_local), local, -1)

    def weight_loader(self, param: nn.Parameter, loaded,
                      shard_id: tuple[int, int | None] | None = None) -> None:
        expert = None if shard_id is None else shard_id[0]
        ranks, rank = self.tp.size, self.tp.rank
        if self.tp.expert_parallel:  # this rank's experts, whole
            ranks, rank = 1, 0
            if expert is None:
                loaded = narrow(loaded, 0, self.first_expert, self.num_local)
            elif not 0 <= expert - self.first_expert < self.num_local:
                return  # another rank's expert
            else:
                expert -= self.first_expert
        local, start = self.intermediate, rank * self.intermediate
        if param is self.down_proj or param is getattr(self, "down_proj_scale_inv", None):
            self._copy(param, loaded, expert, 1, 0, start, local)  # this rank's columns
            return
        # gate/up: this rank's gate rows, then its up rows
        parts = (0, 1) if shard_id is None else (shard_id[1],)
        full = local * ranks
        for part in parts:
            src = start + (part * full if shard_id is None else 0)
            self._copy(param, loaded, expert, 0, part, src, local)

    def _copy(self, param: nn.Parameter, loaded, expert: int | None, dim: int, part: int,
              src: int, size: int) -> None:
        """Rows (``dim`` 0) of part ``part`` or columns (1) ``[src, src + size)`` of one
        expert's matrix (``expert``) or of every expert's (None, ``loaded`` fused) into
        ``param``: for a scale grid, the blocks covering them; a float tensor into an FP8
        weight is quantized, its grid filled alongside."""
        weight = param is self.gate_up_proj or param is self.down_proj
        block = None if self.block is None else self.block[dim]
        dim += 0 if expert is not None else 1  # ``loaded`` and ``target``: with experts first
        target = param.data if expert is None else param.data[expert]
        dst = part * size
        if block is not None and not weight:  # a scale grid
            dst, src, size = part * cdiv(size, block), src // block, cdiv(size, block)
        piece = narrow(loaded, dim, src, size)
        if weight and block is not None and piece.dtype != FP8:
            piece, inv = quantize(piece, self.block)
            grid = self.gate_up_proj_scale_inv if param is self.gate_up_proj else (
                self.down_proj_scale_inv)
            grid = grid.data if expert is None else grid.data[expert]
            grid.narrow(dim, part * inv.shape[dim], inv.shape[dim]).copy_(inv)
        target.narrow(dim, dst, size).copy_(piece)


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
        return self.tp.all_reduce(self.routed(x)), residual

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for normed ``x``: this rank's share, before the
        all-reduce."""
        logits = kernels.linear(x, self.gate.weight)
        weights, ids = kernels.moe_route(logits, self.top_k, self.norm_topk_prob)
        return kernels.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj,
                                   weights, self.experts.local_ids(ids), **self.experts.scales)
