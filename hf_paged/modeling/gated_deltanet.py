"""The Gated DeltaNet ("linear attention") layer of Qwen3-Next and Qwen3.5 over per-sequence
state slots: transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` in numbers,
on a packed batch.

Input projections, merged into one (``in_proj_qkvzba``; Qwen3-Next's ``in_proj_qkvz`` and
``in_proj_ba``, each key head's rows together, or Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``, the first every head's query rows, then key, then value), the
short causal convolution over the query/key/value channels, the gated delta rule, the gated
RMSNorm and ``out_proj``. Each sequence keeps its state in a slot of two pools the worker
attaches, ``conv_state [slots, channels, kernel]`` (model dtype) and ``recurrent_state
[slots, value_heads, key_dim, value_dim]`` (float32); a step's
``AttentionMetadata.state_slots`` names each sequence's slot and ``has_initial_state``
whether the slot holds its earlier tokens' state. The model call's padded rows
(``AttentionMetadata.padded_rows``) run in their own order, each row one sequence.

Under tensor parallelism a rank holds whole key heads and the value heads that read them: its
rows of every input projection, its channels of the convolution (its query, key and value
heads'), its ``A_log`` / ``dt_bias`` entries, its columns of ``out_proj`` (all-reduced).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_paged import kernels
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.linear import (
    RowParallelLinear,
    StackedColumnParallelLinear,
    divide,
    keep_computing,
    narrow,
)
from hf_paged.modeling.tp import SINGLE, TensorParallel


class GatedDeltaNetShape:
    """A config's Gated DeltaNet sizes, whole and on one of ``tp_size`` ranks; raises
    ValueError naming both numbers when the ranks cannot split the heads."""

    def __init__(self, config: PretrainedConfig, tp_size: int = 1):
        self.key_heads = divide(config.linear_num_key_heads, tp_size, "linear_num_key_heads")
        self.value_heads = divide(config.linear_num_value_heads, tp_size,
                                  "linear_num_value_heads")
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({config.linear_num_value_heads}) is not a "
                             f"multiple of linear_num_key_heads ({config.linear_num_key_heads})")
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        # This rank's channels of the query, the key and the value: the convolution's parts.
        self.parts = [self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim]
        self.channels = sum(self.parts)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """One slot's state tensors on this rank (None: the model dtype)."""
        return {"conv_state": ((self.channels, self.kernel_size), None),
                "recurrent_state": ((self.value_heads, self.key_dim, self.value_dim),
                                    torch.float32)}


class ParallelConv1d(nn.Module):
    """The depthwise convolution's ``weight [channels, 1, kernel]`` (transformers'
    ``nn.Conv1d`` layout), this rank's query, key and value channels."""

    def __init__(self, shape: GatedDeltaNetShape, tp: TensorParallel):
        super().__init__()
        self.tp, self.parts = tp, shape.parts
        self.weight = nn.Parameter(torch.empty(shape.channels, 1, shape.kernel_size),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        dst = src = 0
        for size in self.parts:
            param.data[dst:dst + size].copy_(narrow(loaded, 0, src + self.tp.rank * size, size))
            dst, src = dst + size, src + size * self.tp.size


class GatedRMSNorm(nn.Module):
    """``Qwen3NextRMSNormGated``'s weight (one value head's width, replicated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps


def projection_groups(config: PretrainedConfig, split_projections: bool) -> list[list[int]]:
    """The rows of each checkpoint projection merged into ``in_proj_qkvzba``, by part that
    ranks split on its own: Qwen3.5's (``split_projections``) ``in_proj_qkv`` (query, key,
    value), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next's ``in_proj_qkvz`` and
    ``in_proj_ba``, whose rows are grouped by key head (a rank's rows are one slice)."""
    heads = config.linear_num_value_heads
    key_dim = config.linear_key_head_dim * config.linear_num_key_heads
    value_dim = config.linear_value_head_dim * heads
    if split_projections:
        return [[key_dim, key_dim, value_dim], [value_dim], [heads], [heads]]
    return [[2 * key_dim + 2 * value_dim], [2 * heads]]


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; ``split_projections``: Qwen3.5's four input projections, else
    Qwen3-Next's two interleaved ones."""

    def __init__(self, config: PretrainedConfig, split_projections: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        shape = self.shape = GatedDeltaNetShape(config, tp.size)
        hidden, value_dim = config.hidden_size, shape.value_dim * config.linear_num_value_heads
        self.split_projections, self.tp = split_projections, tp
        self.in_proj_qkvzba = StackedColumnParallelLinear(
            hidden, projection_groups(config, split_projections), tp=tp)
        self.conv1d = ParallelConv1d(shape, tp)
        self.activation = config.hidden_act
        self.dt_bias = nn.Parameter(torch.empty(shape.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(shape.value_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden, tp=tp)
        keep_computing(self, "out_proj")
        self.conv_state = self.recurrent_state = torch.empty(0)  # the worker's pools

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """``dt_bias`` / ``A_log``: this rank's value heads' entries."""
        size = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp.rank * size, size))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(qkv [T, channels], z [T, Hv, V], b [T, Hv], a [T, Hv])`` of the normed input."""
        s, rows = self.shape, x.shape[0]
        out, value_rows = self.in_proj_qkvzba(x), s.value_heads * s.value_dim
        if self.split_projections:
            qkv, z, b, a = out.split([s.channels, value_rows, s.value_heads, s.value_heads], -1)
            return qkv, z.view(rows, -1, s.value_dim), b, a
        # transformers' fix_query_key_value_ordering: per key head [q, k, v..., z...], [b, a]
        group = s.value_heads // s.key_heads
        qkvz, ba = out.split([s.channels + value_rows, 2 * s.value_heads], -1)
        q, k, v, z = qkvz.view(rows, s.key_heads, -1).split(
            [s.key_dim, s.key_dim, group * s.value_dim, group * s.value_dim], dim=-1)
        b, a = ba.view(rows, s.key_heads, 2 * group).split([group, group], -1)
        qkv = torch.cat([t.reshape(rows, -1) for t in (q, k, v)], dim=-1)
        return (qkv, z.reshape(rows, -1, s.value_dim), b.reshape(rows, -1),
                a.reshape(rows, -1))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for ``norm(hidden, residual)``, and the new residual stream; the
        slots ``meta.state_slots`` of the pools advance past this step's tokens."""
        x, residual = norm(hidden, residual) if residual is not None else (norm(hidden), hidden)
        padded = meta.padded_rows
        if padded is not None:  # the model call: each padded row whole, its padding zeroed
            x, meta = padded.gather(x), padded.meta
        s, rows = self.shape, x.shape[0]
        qkv, z, b, a = self._project(x)
        slots, weight = meta.state_slots, self.conv1d.weight[:, 0]
        # One token a sequence: the recurrent kernels (a one-token prompt among them starts
        # from zeros: has_initial_state).
        decode, initial = meta.max_query_len == 1, meta.has_initial_state
        if decode:
            qkv = kernels.causal_conv_decode(qkv, weight, None, self.conv_state, slots,
                                             self.activation, has_initial=initial)
        else:
            qkv = kernels.causal_conv_prefill(qkv, weight, None, meta.cu_seqlens_q,
                                              self.conv_state, slots, initial,
                                              self.activation)
        q, k, v = qkv.split(s.parts, dim=-1)
        q, k = q.view(rows, s.key_heads, s.key_dim), k.view(rows, s.key_heads, s.key_dim)
        v = v.view(rows, s.value_heads, s.value_dim)
        g, beta = kernels.gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if decode:
            out = kernels.gated_delta_decode(q, k, v, g, beta, self.recurrent_state, slots,
                                             use_qk_l2norm=True, has_initial=initial)
        else:
            out = kernels.gated_delta_prefill(q, k, v, g, beta, meta.cu_seqlens_q,
                                              self.recurrent_state, slots, initial,
                                              use_qk_l2norm=True)
        out = kernels.gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        out = self.compute["out_proj"](out.reshape(rows, -1))
        return (out if padded is None else padded.scatter(out)), residual
