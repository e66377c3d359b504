"""LoRA adapters on the projections, unmerged: every adapter the engine holds sits in a slot of
stacked low-rank weights beside each projection it adapts, and each step names the slot of
each of its sequences (or none), so requests on different adapters and on the base model share
one batch.

A projection's ``lora`` (None until an adapter is loaded) is a ``LoraStack``: for a projection
of P parts (q/k/v: 3, gate/up: 2, o and down: 1) it holds ``a [S, P*R, K]`` (part p's
``lora_A`` in rows ``p*R`` up, zero past its rank), ``b [S, N, R]`` (each output row's
``lora_B`` row, zero past its part's rank) and ``scaling [S, P]``; the delta
``scaling * (x @ A^T) @ B^T`` of each row's slot is added by ``kernels.add_lora``. Every stack
of a model reads the step's rows, grouped by adapter (``kernels.lora_tiles``), from one
``LoraBatch``. Zero rows past an adapter's rank add exact zeros, so adapters of different
ranks share a stack. Under tensor parallelism K and N are the rank's (a column-parallel
projection's rows of B, a row-parallel one's columns of A, ``linear.*.lora_shard``): a
row-parallel rank's partial delta is linear in its columns, so the projection's all-reduce sums
it exactly.
"""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.kernels.lora_tiles import LoraTiles


class LoraBatch:
    """The current step's adapter rows, read by every stack of a model: ``rows`` holds the
    step's rows grouped by slot (every row, those on no adapter in tiles of slot -1), or None
    when no sequence of the step uses an adapter."""

    def __init__(self) -> None:
        self.rows: LoraTiles | None = None


class LoraStack:
    """The adapter slots of one projection whose output rows are ``parts`` (this rank's rows of
    each checkpoint tensor it stacks) and whose input has ``in_features`` columns."""

    def __init__(self, parts: list[int], in_features: int, num_slots: int, rank: int,
                 batch: LoraBatch, dtype: torch.dtype, device: torch.device):
        self.parts, self.rank, self.batch = list(parts), rank, batch
        zeros = dict(dtype=dtype, device=device)
        self.a = torch.zeros(num_slots, len(parts) * rank, in_features, **zeros)
        self.b = torch.zeros(num_slots, sum(parts), rank, **zeros)
        self.scaling = torch.zeros(num_slots, len(parts), dtype=torch.float32, device=device)
        self.row_part = torch.repeat_interleave(
            torch.arange(len(parts), dtype=torch.int32, device=device),
            torch.tensor(parts, device=device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scaling))

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor,
             scaling: float) -> None:
        """Part ``part``'s ``lora_A`` (``[r, in_features]``, this rank's input columns) and
        ``lora_B`` (``[rows, r]``, this rank's rows of the part) into ``slot``."""
        r = a.shape[0]
        if r > self.rank:
            raise ValueError(f"an adapter of rank {r} does not fit max_lora_rank {self.rank}")
        first = sum(self.parts[:part])
        rows = slice(part * self.rank, (part + 1) * self.rank)
        self.a[slot, rows].zero_()
        self.a[slot, part * self.rank: part * self.rank + r].copy_(a)
        self.b[slot, first:first + self.parts[part]].zero_()
        self.b[slot, first:first + self.parts[part], :r].copy_(b)
        self.scaling[slot, part] = scaling

    def clear(self, slot: int) -> None:
        """Zero ``slot``: an adapter that does not adapt this projection adds nothing."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scaling[slot].zero_()

    def active(self) -> bool:
        """Whether the step has sequences on an adapter."""
        return self.batch.rows is not None

    def add_to(self, out: torch.Tensor, x: torch.Tensor,
               norm: tuple[torch.Tensor, float] | None = None, gated: bool = False
               ) -> torch.Tensor:
        """``out`` (the projection of ``x``; ``norm``: of ``rms_norm(x)`` with that weight and
        eps) plus each row's adapter delta, in place; ``gated``: the SwiGLU product of that
        sum (the merged gate/up projection), a new tensor."""
        rows = self.batch.rows
        if rows is None:
            return kernels.silu_and_mul(out) if gated else out
        return kernels.add_lora(out, x, self.a, self.b, self.scaling, self.row_part, rows,
                                norm, gated)
