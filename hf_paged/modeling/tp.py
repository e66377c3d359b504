"""This process's place in a tensor-parallel group, as the sharded modules see it.

The group is passed explicitly (never read from torch.distributed's default group), so a
process group that the user or accelerate started for data parallelism shards nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``size`` ranks; ``group`` carries the device collectives (NCCL on CUDA,
    gloo on CPU) and is None when there is one rank. ``fast_all_reduce``, when set, returns
    the sum of a tensor over the ranks, or None to leave it to the group. ``expert_parallel``:
    routed experts are split whole over the ranks, not by their intermediate size
    (``EngineConfig.moe_parallel``)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False
    fast_all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = field(
        default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (``x`` itself may be overwritten)."""
        if self.size == 1:
            return x
        reduced = self.fast_all_reduce(x) if self.fast_all_reduce else None
        if reduced is None:
            dist.all_reduce(x, group=self.group)
            return x
        return reduced

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` into every rank's ``x``."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def gather_last_dim(self, x: torch.Tensor, everywhere: bool = False) -> torch.Tensor | None:
        """Every rank's ``x`` side by side on the last dimension, on rank 0 only (None
        elsewhere), or on every rank with ``everywhere``."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if everywhere:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts, -1)
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, -1) if parts is not None else None


SINGLE = TensorParallel()


def kv_head_layout(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """Query heads and KV heads per rank; KV heads are replicated when there are fewer of them
    than ranks. Raises ValueError naming both numbers when the split is impossible."""
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads}), so the KV heads cannot be replicated evenly"
        )
    return num_heads // tp_size, max(num_kv_heads // tp_size, 1)
