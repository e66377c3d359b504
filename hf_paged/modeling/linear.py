"""Linear layers that know their tensor-parallel shard and load checkpoint weights into it.

Column-parallel layers split the output features across ranks, row-parallel layers the input
features (and all-reduce their partial sums). The merged layers (QKV, gate/up) hold several
checkpoint tensors side by side; their ``weight_loader`` takes a ``shard_id`` saying which.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tp_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: tuple[int, int]):
        super().__init__()
        self.tp_rank, self.tp_size = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp=None):
        tp = tp or tp_rank_and_size()
        super().__init__(in_features, _divide(out_features, tp[1], "output features"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored side by side (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, tp=None):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix; each rank holds whole heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp=None):
        tp = tp or tp_rank_and_size()
        self.num_heads = _divide(num_heads, tp[1], "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp[1], "num_key_value_heads")
        self.head_dim = head_dim
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial products are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp=None):
        tp = tp or tp_rank_and_size()
        super().__init__(_divide(in_features, tp[1], "input features"), out_features, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
