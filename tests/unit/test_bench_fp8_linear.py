"""The FP8 projection benchmark's CPU-side parts: the projection shapes, the floor, and the
weights it quantizes (the timings themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_fp8_linear import floor_seconds, projection_shapes, quantized
from hf_paged.kernels.block_scales import dequantize


def test_projection_shapes_are_qwen3s_merged_projections():
    assert projection_shapes("8b") == {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                                       "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
    assert projection_shapes("0.6b")["qkv_proj"] == (4096, 1024)


def test_floor_is_bytes_or_flops_whichever_is_slower():
    # 1,000 x 1,000 one-byte weights and 2-byte inputs and outputs at 1e9 B/s; 2e9 FLOPs at
    # 1,000 rows.
    assert floor_seconds(1000, 1000, 1, 1.0, 1e9, 1e12) == pytest.approx(1.004e-3)
    assert floor_seconds(1000, 1000, 1000, 1.0, 1e9, 1e11) == pytest.approx(2e-2)
    assert floor_seconds(1000, 1000, 1000, 1.0, 1e9, None) == pytest.approx(5e-3)


def test_quantized_weights_round_trip_within_fp8_precision():
    weight = torch.randn(300, 200, dtype=torch.bfloat16)
    q, scales = quantized(weight)
    assert q.dtype == torch.float8_e4m3fn and scales.inv.shape == (3, 2)
    assert torch.equal(scales.inv[0, 0], weight[:128, :128].float().abs().max() / 448)
    back = dequantize(q, scales, torch.float32)
    torch.testing.assert_close(back, weight.float(), rtol=0.07, atol=1e-2)
