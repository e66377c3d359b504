"""Plain-torch twins of the FP8 kernels: the FP8 KV cache's store and read, and the
block-scaled FP8 projections' GEMMs (``reference`` re-exports them beside every other twin).
The definitions these follow (the scale grid, its dequantization) are ``block_scales``'."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels.block_scales import FP8, FP8_MAX, MIN_AMAX, BlockScales, dequantize


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[T, Hkv, D]`` keys or values as an FP8 cache holds them: divided by their KV head's
    float32 ``scale [Hkv]`` in float32, saturated to +-448, rounded to nearest even."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 cache rows ``[..., Hkv, D]`` back to ``dtype``: times their KV head's scale."""
    return (x.float() * scale[:, None]).to(dtype)


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization for fine-grained FP8, as transformers' ``act_quant``:
    each row of ``x [M, K]`` in groups of ``group`` columns (the last one cut short), scale
    ``amax / 448`` (amax at least ``MIN_AMAX``), values ``x / scale`` in float8_e4m3fn.
    Returns ``(q [M, K], scales float32 [M, ceil(K / group)])``."""
    m, k = x.shape
    groups = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scales = groups.abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(1)[:, :k], scales


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over the block-quantized FP8 ``weight`` dequantized to ``x``'s dtype."""
    return F.linear(x, dequantize(weight, scales, x.dtype), bias)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 projection with FP8 activations: ``x`` quantized by ``act_quant`` in groups
    of ``scales.block_k``, both operands dequantized, multiplied in float32, cast to ``x``'s
    dtype."""
    q, a_scales = act_quant(x, scales.block_k)
    a = q.float() * a_scales.repeat_interleave(scales.block_k, dim=-1)[:, :x.shape[1]]
    out = F.linear(a, dequantize(weight, scales, torch.float32),
                   None if bias is None else bias.float())
    return out.to(x.dtype)
