"""Block-scaled FP8 weights: the scale grid that goes with a float8_e4m3fn weight.

A fine-grained FP8 checkpoint stores each projection's weight ``[N, K]`` in float8_e4m3fn with a
float32 ``weight_scale_inv`` grid ``[ceil(N / 128), ceil(K / 128)]``: weight element ``(n, k)``
means ``weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (the last block of a dimension
that is not a multiple of 128 is cut short). A merged projection (q/k/v, gate/up) stacks its
parts' weights and their grids; when a part's rows are not a multiple of 128 its grid rows no
longer line up with ``n // 128`` of the stacked weight, so every kernel reads the grid through
``rows``: the grid row of each weight row. Experts' grids carry the expert as a leading
dimension (``inv [E, S, ceil(K / 128)]``), their ``rows`` is shared.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# The smallest amax an activation group is scaled by: an all-zero group gets a tiny scale
# rather than 0, whose quotients would be NaN.
MIN_AMAX = 1e-10


class BlockScales(NamedTuple):
    """The scales of one block-quantized weight, as the kernels take them."""

    inv: torch.Tensor  # float32 [..., S, ceil(K / block_k)]: the stacked weight_scale_inv grids
    rows: torch.Tensor  # int32 [N]: the row of ``inv`` that weight row n reads
    block_k: int  # input features a grid column covers


def grid_rows(part_rows: list[int], block_n: int, device: torch.device | None = None
              ) -> torch.Tensor:
    """``BlockScales.rows`` for a weight stacking parts of ``part_rows`` rows, each with its own
    grid of ``ceil(rows / block_n)`` rows, stacked in the same order."""
    rows, first = [], 0
    for n in part_rows:
        rows.append(first + torch.arange(n, dtype=torch.int32, device=device) // block_n)
        first += -(-n // block_n)
    return torch.cat(rows)


def dequantize(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values, ``weight[..., n, k] * inv[..., rows[n], k // block_k]`` computed in
    float32 and rounded once to ``dtype`` (as transformers dequantizes an FP8 checkpoint)."""
    k = weight.shape[-1]
    per_row = scales.inv.float().index_select(-2, scales.rows.long().to(scales.inv.device))
    per_element = per_row.repeat_interleave(scales.block_k, dim=-1)[..., :k]
    return (weight.float() * per_element).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` -> (its float8_e4m3fn values, its float32 ``weight_scale_inv``
    grid ``[..., ceil(N / bn), ceil(K / bk)]``), as transformers' ``Fp8Quantize`` computes them:
    per block, in float32, the scale maps the block's max |w| to e4m3's maximum (an all-zero
    block keeps scale 1), values are clamped and cast. A block cut short by the end of a
    dimension takes the max of the elements it has (transformers leaves such a weight
    unquantized)."""
    bn, bk = block
    n, k = weight.shape[-2:]
    grid_n, grid_k = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(weight.float(), (0, grid_k * bk - k, 0, grid_n * bn - n))
    blocks = padded.reshape(*weight.shape[:-2], grid_n, bn, grid_k, bk)
    max_abs = blocks.abs().amax(dim=(-3, -1))
    nonzero = max_abs > 0
    scales = torch.finfo(FP8).max / torch.where(nonzero, max_abs, torch.ones_like(max_abs))
    scales = torch.where(nonzero, scales, torch.ones_like(scales))
    values = (blocks * scales.unsqueeze(-1).unsqueeze(-3)).clamp(torch.finfo(FP8).min,
                                                                  torch.finfo(FP8).max)
    values = values.to(FP8).reshape(padded.shape)[..., :n, :k].contiguous()
    return values, (1.0 / scales).to(torch.float32)
