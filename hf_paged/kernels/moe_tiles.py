"""Tiles of the mixture-of-experts grouped GEMMs (``moe_gemm``): the default by rows per
expert, measured on an H100, for bf16 and for block-quantized FP8 experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the grouped GEMMs: ``block_m`` pairs (of one expert) by ``block_n`` outputs,
    ``block_k`` along the reduction; ``group_m`` blocks share a column of output tiles
    before moving on (weight tiles reused from L2). One config serves both GEMMs; the
    gate/up programs hold two accumulators, so their weight tile is ``2 * block_n`` rows."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_config(num_tokens: int, num_experts: int, top_k: int, n: int, k: int,
               dtype: torch.dtype, fp8: bool = False) -> MoEConfig:
    """Default tiles for ``num_tokens`` routed to ``top_k`` of ``num_experts`` experts, with
    intermediate size ``n`` (per rank) and hidden size ``k``.

    The tier follows the mean rows per expert, ``num_tokens * top_k / num_experts``. Decode
    (up to 8) reads weights for very few rows: the smallest M tile the tensor cores take (16)
    and long steps along K. Prefill grows M with the rows per expert, up to 128, and groups M
    blocks so that weight tiles are reused from L2. On an H100 at Qwen3-30B-A3B's shape (128
    experts, k 8, hidden 2,048, intermediate 768, bf16), these came within 5% of the best of
    a sweep over tiles, warps and stages at 1, 4, 16, 64, 256, 512, 1,024, 2,048 and 8,192
    tokens; every tier fits in 164 KiB of shared memory (an A100's).

    ``fp8``: the experts are block-quantized FP8 (a K tile never wider than the 128-column
    scale block). Their decode tier takes narrower N tiles (more programs stream the halved
    weight bytes) and the next one wider N tiles, grouped: on the H100 and shape above, 5-8%
    faster than the bf16 tiers at 1, 4, 16 and 256 tokens, within 3-5% of the best of a sweep
    at 2,048 and 8,192 with the bf16 prefill tiers.
    """
    rows = num_tokens * top_k / max(num_experts, 1)
    if rows <= 8:
        cfg = MoEConfig(16, 32 if fp8 else 64, 128, 1, 4, 3)
    elif rows <= 24:
        cfg = MoEConfig(32, 128, 128, 8, 4, 3) if fp8 else MoEConfig(32, 64, 128, 1, 4, 3)
    elif rows <= 96:
        cfg = MoEConfig(64, 128, 64, 8, 4, 3)
    else:
        cfg = MoEConfig(128, 128, 64, 8, 8, 3)
    # Tiles no wider than the matrices (small models), at least the tensor cores' 16; float32
    # operands take twice the shared memory a stage.
    limit = max(16, triton.next_power_of_2(min(n, k)))
    block_k = cfg.block_k // 2 if dtype == torch.float32 else cfg.block_k
    return MoEConfig(cfg.block_m, min(cfg.block_n, limit), max(16, min(block_k, limit)),
                     cfg.group_m, cfg.num_warps, cfg.num_stages)
