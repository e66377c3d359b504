"""Linear layers that know their tensor-parallel shard and load checkpoint weights into it.

Column-parallel layers split the output features across ranks, row-parallel layers the input
features (and all-reduce their partial sums). The merged layers (QKV, gate/up) hold several
checkpoint tensors side by side; their ``weight_loader`` takes a ``shard_id`` saying which.
A loader receives a torch tensor or a safetensors slice and reads only its rank's part.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout


def narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[start:start+size]`` along ``dim``; on a safetensors slice this reads only
    those bytes from the file."""
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def divide(n: int, d: int, what: str) -> int:
    """``n / d``; a ValueError naming ``what`` when ranks cannot split it evenly."""
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.small_m_rows = 0  # up to how many rows the small-M kernel serves (start-up's choice)
        self.w8a8_rows = 0  # FP8 weights: from how many rows the w8a8 GEMM serves (start-up's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self.small_m_rows,
                              w8a8_rows=self.w8a8_rows)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__(in_features, divide(out_features, tp.size, "output features"), bias, tp)

    def normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
               gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x, residual)[0]), x + residual)`` (``gated``: the SwiGLU product of
        the merged gate/up output), in one small-M kernel where it serves (the norm is an
        ``RMSNorm``, whose launch that saves)."""
        return kernels.normed_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                     self.small_m_rows, gated, w8a8_rows=self.w8a8_rows)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored side by side (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp: TensorParallel = SINGLE):
        for size in out_sizes:
            divide(size, tp.size, "intermediate_size")
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix; each rank holds whole heads. With
    fewer KV heads than ranks, each KV head is replicated on ``size / num_kv_heads`` ranks
    (the ranks whose query heads read it)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE):
        self.num_heads, self.num_kv_heads = kv_head_layout(num_heads, num_kv_heads, tp.size)
        self.kv_shard = tp.rank * num_kv_heads // tp.size // self.num_kv_heads
        self.head_dim = head_dim
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, local * tp.size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, index = {
            "q": (0, q, self.tp.rank), "k": (q, kv, self.kv_shard), "v": (q + kv, kv, self.kv_shard)
        }[shard_id]
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, index * size, size))


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial products are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__(divide(in_features, tp.size, "input features"), out_features, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded[()])
            return
        size = param.shape[1]
        param.data.copy_(narrow(loaded, 1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(kernels.linear(x, self.weight, bias, self.small_m_rows,
                                                 w8a8_rows=self.w8a8_rows))
