"""Linear layers that know their tensor-parallel shard and load checkpoint weights into it.

Column-parallel layers split the output features across ranks, row-parallel layers the input
features (and all-reduce their partial sums). The merged layers (QKV, gate/up) hold several
checkpoint tensors side by side; their ``weight_loader`` takes a ``shard_id`` saying which.
A loader receives a torch tensor or a safetensors slice and reads only its rank's part.

A layer may hold its weight block-quantized (``hold_fp8``): float8_e4m3fn with a float32
``weight_scale_inv`` grid, one grid per checkpoint tensor stacked as the weights are. Its
loaders then read the blocks of the grid that cover the rank's rows or columns (the split
never cuts a block: ``check_shardable`` saw to that), and quantize a float checkpoint tensor
as it loads (``from_pretrained(..., quantization_config=...)``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged import kernels
from hf_paged.kernels.block_scales import FP8, BlockScales, grid_rows, quantize
from hf_paged.modeling.lora import LoraStack
from hf_paged.modeling.tp import SINGLE, TensorParallel, kv_head_layout


def narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[start:start+size]`` along ``dim``; on a safetensors slice this reads only
    those bytes from the file."""
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def cdiv(n: int, d: int) -> int:
    return -(-n // d)


def divide(n: int, d: int, what: str) -> int:
    """``n / d``; a ValueError naming ``what`` when ranks cannot split it evenly."""
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def part_index(module: nn.Module, shard: object) -> int:
    """Which of ``module``'s parts a weight loader's ``shard`` id names (``"q"``/``"k"``/
    ``"v"`` of a QKV projection, a merged projection's index; None: the whole weight)."""
    if shard is None:
        return 0
    return ("q", "k", "v").index(shard) if isinstance(module, QKVParallelLinear) else int(shard)


def keep_computing(module: nn.Module, name: str) -> None:
    """Let ``module``'s forward call its projection ``name`` through ``module.compute[name]``,
    an unregistered reference: peft wraps a projection it adapts in its own layer (``o_proj``,
    ``down_proj``), which would compute its adapters unfused, per call; the step keeps calling
    the projection itself, whose adapters the engine adds (``modeling.lora``)."""
    module.__dict__.setdefault("compute", {})[name] = getattr(module, name)


class _ParallelLinear(nn.Linear):
    """An ``nn.Linear`` to the libraries that look for one (peft wraps projections it finds so
    and reads their ``in_features`` / ``out_features``, the whole model's), holding this rank's
    shard."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a weight
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.small_m_rows = 0  # up to how many rows the small-M kernel serves (start-up's choice)
        self.w8a8_rows = 0  # FP8 weights: from how many rows the w8a8 GEMM serves (start-up's)
        self.cublas_rows = 0  # FP8 weights: from how many rows dequantize-then-cuBLAS serves
        self.fp8_mma = "w8a8_linear"  # FP8 weights: the fp8_gemm function of w8a8_rows' rows
        self.block: tuple[int, int] | None = None  # FP8: (rows, columns) a scale covers
        self.lora: LoraStack | None = None  # adapters' low-rank deltas, once one is loaded

    @property
    def parts(self) -> list[int]:
        """This rank's rows of each checkpoint tensor the weight stacks, in order."""
        return [self.weight.shape[0]]

    def hold_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight in float8_e4m3fn with a ``weight_scale_inv`` grid per part, stacked
        (on the meta device, before the model is materialised)."""
        (n, k), (bn, bk) = self.weight.shape, block
        self.block = block
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(sum(cdiv(p, bn) for p in self.parts), cdiv(k, bk), dtype=torch.float32),
            requires_grad=False)
        self.register_buffer("scale_rows", torch.empty(n, dtype=torch.int32), persistent=False)

    def init_scale_rows(self) -> None:
        """Fill the grid row of each weight row, once the model is on its device."""
        self.scale_rows.copy_(grid_rows(self.parts, self.block[0], self.scale_rows.device))

    @property
    def scales(self) -> BlockScales | None:
        """The weight's block scales as the kernels take them; None for a float weight."""
        if self.block is None:
            return None
        return BlockScales(self.weight_scale_inv, self.scale_rows, self.block[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(x, self.weight, self.bias, self.small_m_rows, scales=self.scales,
                             w8a8_rows=self.w8a8_rows, cublas_rows=self.cublas_rows,
                             fp8_mma=self.fp8_mma)
        return out if self.lora is None else self.lora.add_to(out, x)

    def _copy(self, param: nn.Parameter, loaded, dim: int, dst: int, src: int, size: int
              ) -> None:
        """``param``'s rows (``dim`` 0) or columns (1) ``[dst, dst + size)`` of the weight
        from ``loaded``'s ``[src, src + size)``: for the scale grid, the blocks covering them; a
        float tensor into an FP8 weight is quantized, its grid filled alongside. Biases are
        copied as they are."""
        if self.block is not None and param is self.weight_scale_inv:
            param.data.narrow(dim, self._grid_start(dim, dst), cdiv(size, self.block[dim])
                              ).copy_(narrow(loaded, dim, src // self.block[dim],
                                             cdiv(size, self.block[dim])))
            return
        piece = narrow(loaded, dim, src, size)
        if param is self.weight and self.block is not None and piece.dtype != FP8:
            piece, inv = quantize(piece, self.block)
            self.weight_scale_inv.data.narrow(dim, self._grid_start(dim, dst),
                                              inv.shape[dim]).copy_(inv)
        param.data.narrow(dim, dst, size).copy_(piece)

    def _grid_start(self, dim: int, start: int) -> int:
        """The grid row (``dim`` 0) or column of weight row or column ``start``, where a part
        (or the rank's columns) begins."""
        if dim == 1:
            return start // self.block[1]
        first = grid = 0
        for rows in self.parts:
            if first == start:
                break
            first, grid = first + rows, grid + cdiv(rows, self.block[0])
        return grid


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__(in_features, divide(out_features, tp.size, "output features"), bias, tp)
        self.in_features, self.out_features = in_features, out_features
        # The model calls it through ``normed`` with an RMSNorm the small-M kernel takes in
        # (set by the family): start-up times the small-M kernel with the norm fused and after
        # the norm's own launch, and sets ``norm_apart`` where the second was faster.
        self.fuses_norm = False
        self.norm_apart = False

    def normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
               gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x, residual)[0]), x + residual)`` (``gated``: the SwiGLU product of
        the merged gate/up output), in one small-M kernel where it serves (the norm is an
        ``RMSNorm``, whose launch that saves) unless start-up set ``norm_apart``. In a step
        with adapter rows the projection keeps its fused norm but not its SwiGLU product,
        which comes after the deltas: the LoRA kernels normalise the residual stream
        themselves and, for gate/up, take the product in their last launch (adapters are
        served on families whose norms have no offset)."""
        lora = self.lora is not None and self.lora.active()
        out, residual = kernels.normed_linear(
            x, residual, norm.weight, norm.eps, self.weight, self.bias, self.small_m_rows,
            gated and not lora, scales=self.scales, w8a8_rows=self.w8a8_rows, offset=norm.offset,
            cublas_rows=self.cublas_rows, fuse=not self.norm_apart, fp8_mma=self.fp8_mma)
        if lora:
            out = self.lora.add_to(out, residual, (norm.weight, norm.eps), gated)
        return out, residual

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = self.weight.shape[0]
        self._copy(param, loaded, 0, 0, self.tp.rank * size, size)

    def lora_shard(self, part: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of part ``part``'s whole ``lora_A`` / ``lora_B``: B's rows of
        the part's rows the weight loader gives the rank, A whole."""
        rows = self.parts[part]
        return a, narrow(b, 0, self._part_shard(part) * rows, rows)

    def _part_shard(self, part: int) -> int:
        """Which of its slices of part ``part``'s rows the rank holds."""
        return self.tp.rank


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored side by side (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp: TensorParallel = SINGLE):
        for size in out_sizes:
            divide(size, tp.size, "intermediate_size")
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)

    @property
    def parts(self) -> list[int]:
        return [size // self.tp.size for size in self.out_sizes]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        self._copy(param, loaded, 0, offset, self.tp.rank * size, size)


class StackedColumnParallelLinear(MergedColumnParallelLinear):
    """Column-parallel outputs stored side by side where a checkpoint tensor may hold several
    of them (Qwen3.5's ``in_proj_qkv``: every head's query rows, then key, then value, each
    split over the ranks on its own): ``groups[i]`` are the sizes of the parts of checkpoint
    tensor (shard id) ``i``. Each rank holds its slice of every part, in order."""

    def __init__(self, in_features: int, groups: list[list[int]], bias: bool = False,
                 tp: TensorParallel = SINGLE):
        self.groups = groups
        super().__init__(in_features, [size for group in groups for size in group], bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        """Each part's rows of checkpoint tensor ``shard_id``; of an FP8 scale grid, the
        blocks covering them (every part but the last starts and ends on a block: the family's
        ``check_shardable`` saw to that)."""
        first = sum(len(group) for group in self.groups[:shard_id])
        rows = self.block[0] if self.block is not None and param is self.weight_scale_inv else 1
        start = 0
        for part, size in enumerate(self.groups[shard_id], first):
            piece = narrow(loaded, 0, start // rows, cdiv(size, rows))
            super().weight_loader(param, piece, part)
            start += size


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix; each rank holds whole heads. With
    fewer KV heads than ranks, each KV head is replicated on ``size / num_kv_heads`` ranks
    (the ranks whose query heads read it). ``gated_query``: each query head's rows are
    followed by as many rows of its output gate (Qwen3-Next's and Qwen3.5's ``q_proj``)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE, gated_query: bool = False):
        self.num_heads, self.num_kv_heads = kv_head_layout(num_heads, num_kv_heads, tp.size)
        self.kv_shard = tp.rank * num_kv_heads // tp.size // self.num_kv_heads
        self.head_dim = head_dim
        self.q_head_rows = head_dim * (2 if gated_query else 1)
        local = self.num_heads * self.q_head_rows + 2 * self.num_kv_heads * head_dim
        super().__init__(hidden, local * tp.size, bias, tp)

    @property
    def parts(self) -> list[int]:
        q, kv = self.num_heads * self.q_head_rows, self.num_kv_heads * self.head_dim
        return [q, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q, kv = self.num_heads * self.q_head_rows, self.num_kv_heads * self.head_dim
        offset, size, index = {
            "q": (0, q, self.tp.rank), "k": (q, kv, self.kv_shard), "v": (q + kv, kv, self.kv_shard)
        }[shard_id]
        self._copy(param, loaded, 0, offset, index * size, size)

    def _part_shard(self, part: int) -> int:
        return self.tp.rank if part == 0 else self.kv_shard  # replicated KV heads


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial products are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__(divide(in_features, tp.size, "input features"), out_features, bias, tp)
        self.in_features, self.out_features = in_features, out_features

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded[()])
            return
        size = self.weight.shape[1]
        self._copy(param, loaded, 1, 0, self.tp.rank * size, size)

    def lora_shard(self, part: int, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the whole ``lora_A`` / ``lora_B``: A's columns of the rank's
        input columns, B whole (the rank's partial delta is summed by the all-reduce)."""
        size = self.weight.shape[1]
        return narrow(a, 1, self.tp.rank * size, size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (a block that sums several
        shares reduces them once)."""
        bias = self.bias if self.tp.rank == 0 else None
        out = kernels.linear(x, self.weight, bias, self.small_m_rows, scales=self.scales,
                             w8a8_rows=self.w8a8_rows, cublas_rows=self.cublas_rows,
                             fp8_mma=self.fp8_mma)
        if self.lora is not None:  # a rank's share of the delta, summed with the products
            out = self.lora.add_to(out, x)
        return out
