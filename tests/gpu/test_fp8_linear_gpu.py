"""On a CUDA GPU, in bf16, the FP8 projections on the Qwen3-8B layer shapes against their
plain-torch twins: the small-M kernel at 1-8 rows (plain, gated, normed) and both block-scaled
GEMMs at every tile size (16, 64 and more rows), with and without a bias. What the
interpreter cannot show: the hardware's FP8 conversions, the FP8 tensor cores' accumulation
and the compiled tiles on full-size weights."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import fp8_gemm, reference, small_m
from hf_paged.kernels.block_scales import FP8, BlockScales, grid_rows

pytestmark = pytest.mark.gpu
# (rows of each merged part, K): 8B's qkv (4096 + 1024 + 1024 rows), gate/up, down; a merged
# projection whose parts are not multiples of 128.
SHAPES = [([4096, 1024, 1024], 4096), ([12288, 12288], 4096), ([4096], 12288),
          ([1000, 200, 200], 1000)]


def fp8_weight(parts: list[int], k: int) -> tuple[torch.Tensor, BlockScales]:
    weight = (torch.randn(sum(parts), k, device="cuda") * 64).clamp(-448, 448).to(FP8)
    rows = grid_rows(parts, 128, torch.device("cuda"))
    inv = (0.5 + torch.rand(int(rows.max()) + 1, -(-k // 128), device="cuda")) / (64 * k**0.5)
    return weight, BlockScales(inv, rows, 128)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-2) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("parts,k", SHAPES)
def test_small_m(parts, k):
    weight, scales = fp8_weight(parts, k)
    for rows in (1, 2, 5, small_m.MAX_ROWS):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert_near(small_m.linear(x, weight, scales),
                    reference.dequant_linear(x, weight, scales))
    if len(parts) == 2:
        expected = reference.silu_and_mul(reference.dequant_linear(x, weight, scales))
        assert_near(small_m.gated_linear(x, weight, scales), expected)
    residual = torch.randn_like(x)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    out, new_residual = small_m.normed_linear(x, residual, norm, 1e-6, weight, False, scales)
    normed, expected_residual = reference.add_rms_norm(x, residual, norm, 1e-6)
    assert_near(out, reference.dequant_linear(normed, weight, scales))
    assert torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("parts,k", SHAPES)
@pytest.mark.parametrize("name", ["dequant_linear", "w8a8_linear", "cublas_linear",
                                  "scaled_mm_linear"])
def test_gemms(name, parts, k):
    """Each GEMM against its twin (the cuBLAS path's is the dequantizing GEMM's, torch's
    block-scaled GEMM's the w8a8 one's), torch's where it takes the weight: on an H100 or
    H200 every 8B shape, never a part cut short of a block."""
    weight, scales = fp8_weight(parts, k)
    if name == "scaled_mm_linear":
        serves = fp8_gemm.scaled_mm_serves(weight, scales)
        sm90 = torch.cuda.get_device_capability() == (9, 0)
        assert serves == (sm90 and all(p % 128 == 0 for p in parts) and k % 512 == 0)
        if not serves:  # start-up never times it here: nothing more to compare
            return
    bias = torch.randn(sum(parts), device="cuda", dtype=torch.bfloat16)
    twin = getattr(reference, {"cublas_linear": "dequant_linear",
                               "scaled_mm_linear": "w8a8_linear"}.get(name, name))
    for rows in (9, 16, 50, 300):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        for b in (None, bias):
            assert_near(getattr(fp8_gemm, name)(x, weight, scales, b), twin(x, weight, scales, b))


def test_act_quant_on_the_hardware():
    """The hardware's conversion rounds as the twin: the same bits, but for quotients within
    a rounding of a tie (the kernel divides exactly; torch's division may differ by an ulp)."""
    x = torch.randn(64, 4100, device="cuda", dtype=torch.bfloat16)
    q, scales = fp8_gemm.act_quant(x, 128)
    want_q, want_scales = reference.act_quant(x, 128)
    assert torch.equal(scales, want_scales)
    assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-4


def test_float32_dequant_is_exact_math():
    """float32 activations are multiplied in full float32 (no TF32)."""
    weight, scales = fp8_weight([300], 1000)
    x = torch.randn(100, 1000, device="cuda")
    assert_near(kernels.linear(x, weight, scales=scales),
                reference.dequant_linear(x, weight, scales), tol=1e-5)
