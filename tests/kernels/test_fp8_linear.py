"""The FP8 projections (block-quantized float8_e4m3fn weights) against their plain-torch twins:
the small-M kernel reading FP8 strips (plain, gated, normed), the activations' quantization and
the two block-scaled GEMMs, on sizes that fill no 128-block (merged parts whose rows are not
multiples of 128 included), and the dispatch between them. Triton's interpreter runs FP8
tensors and FP8 ``tl.dot``; its float32 to FP8 conversion misrounds, which the quantization
kernel avoids by rounding in float32 first (``kernels.e4m3``)."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import fp8_gemm, reference, small_m
from hf_paged.kernels.block_scales import FP8, BlockScales, dequantize, grid_rows
from tests.kernels.conftest import DEVICE, HALF

# (rows of each merged part, input features): one aligned part; unaligned parts and K.
SHAPES = [([128], 256), ([100, 36], 300)]


def fp8_weight(parts: list[int], k: int, seed: int = 0) -> tuple[torch.Tensor, BlockScales]:
    """A random FP8 weight stacking ``parts`` and its scale grid (values about 1 / sqrt(k))."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(sum(parts), k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    rows = grid_rows(parts, 128)
    inv = (0.5 + torch.rand(int(rows.max()) + 1, -(-k // 128), generator=gen)) / (64 * k**0.5)
    return weight.to(DEVICE), BlockScales(inv.to(DEVICE), rows.to(DEVICE), 128)


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> None:
    """Within ``tol`` (default 1e-4 in float32, 1e-2 in 16 bits) of the largest expected
    magnitude; never NaN."""
    tol = tol or (1e-4 if actual.dtype == torch.float32 else 1e-2)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, 3, small_m.MAX_ROWS])
@pytest.mark.parametrize("parts,k", SHAPES)
def test_small_m_linear(dtype, rows, parts, k):
    weight, scales = fp8_weight(parts, k)
    x = rand(rows, k, dtype=dtype)
    assert_near(small_m.linear(x, weight, scales), reference.dequant_linear(x, weight, scales))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("inter,k", [(128, 256), (72, 300)])
def test_small_m_gated_linear(rows, inter, k):
    """A merged gate/up weight whose halves' grids do not line up with its rows when
    ``inter`` is not a multiple of 128."""
    weight, scales = fp8_weight([inter, inter], k)
    x = rand(rows, k, dtype=HALF)
    expected = reference.silu_and_mul(reference.dequant_linear(x, weight, scales))
    assert_near(small_m.gated_linear(x, weight, scales), expected)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,k", [(1, 256), (3, 300)])
def test_small_m_normed_linear(gated, with_residual, rows, k):
    weight, scales = fp8_weight([40, 40], k)
    x = rand(rows, k, dtype=HALF)
    residual = rand(rows, k, dtype=HALF) if with_residual else None
    norm = (1 + torch.randn(k, device=DEVICE) / 4).to(HALF)
    out, new_residual = small_m.normed_linear(x, residual, norm, 1e-6, weight, gated, scales)
    if with_residual:
        normed, expected_residual = reference.add_rms_norm(x, residual, norm, 1e-6)
    else:
        normed, expected_residual = reference.rms_norm(x, norm, 1e-6), x
    expected = reference.dequant_linear(normed, weight, scales)
    assert_near(out, reference.silu_and_mul(expected) if gated else expected)
    assert torch.equal(new_residual, expected_residual)


def test_act_quant_matches_its_twin_bit_for_bit():
    """Groups cut short, an all-zero group, values on the largest magnitude, quotients that
    round up into the next binade or tie between two FP8 values, and negative ones that round
    to -0."""
    torch.manual_seed(281)  # a draw with a small negative value in row 3's first group
    x = rand(5, 300, dtype=torch.float32)
    x[3, 4] = -1e-4
    x[1, 128:256] = 0
    x[2, :128] = torch.linspace(-448, 448, 128)
    x[3, :4] = torch.tensor([448.0, 124.3, 124.0, 13.5])  # ties: to 128 and to 14
    for dtype in (torch.float32, HALF):
        q, scales = fp8_gemm.act_quant(x.to(dtype), 128)
        want_q, want_scales = reference.act_quant(x.to(dtype), 128)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [20, 70])
@pytest.mark.parametrize("parts,k", SHAPES)
@pytest.mark.parametrize("name", ["dequant_linear", "w8a8_linear", "cublas_linear"])
def test_gemms(name, dtype, rows, parts, k):
    """The w8a8 GEMM to 1e-2 in any dtype: a GPU's FP8 tensor cores accumulate a K block's
    products with fewer bits than float32 (the interpreter's are exact). The cuBLAS path has
    the dequantizing GEMM's twin."""
    weight, scales = fp8_weight(parts, k)
    x = rand(rows, k, dtype=dtype)
    bias = rand(sum(parts), dtype=dtype) if rows == 70 else None
    twin = "dequant_linear" if name == "cublas_linear" else name
    expected = getattr(reference, twin)(x, weight, scales, bias)
    assert_near(getattr(fp8_gemm, name)(x, weight, scales, bias), expected,
                1e-2 if name == "w8a8_linear" else None)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("parts,k", SHAPES)
def test_dequantize_weight_bit_for_bit(dtype, parts, k):
    """The cuBLAS path's scratch weight is exactly the plain path's dequantized one."""
    weight, scales = fp8_weight(parts, k)
    assert torch.equal(fp8_gemm.dequantize_weight(weight, scales, dtype),
                       dequantize(weight, scales, dtype))


def test_w8a8_twin_stays_near_the_definition():
    """The activations' rounding to FP8 moves the w8a8 product by a few percent at most."""
    weight, scales = fp8_weight([100, 36], 300)
    x = rand(20, 300, dtype=torch.float32)
    exact = reference.dequant_linear(x, weight, scales)
    error = (reference.w8a8_linear(x, weight, scales) - exact).abs().max()
    assert 0 < error < 0.05 * exact.abs().max()


def test_dispatch(monkeypatch):
    """FP8 projections go to the small-M kernel up to its rows, to the dequantizing GEMM
    below ``w8a8_rows``, to the w8a8 one from there (``fp8_mma``: the one start-up chose) and
    to cuBLAS from ``cublas_rows``; off Triton, to the plain path."""
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    calls = []
    monkeypatch.setattr(kernels, "_triton_kernel", lambda module, name: lambda *a: (
        calls.append(name) or torch.zeros(a[0].shape[0], 48, device=DEVICE)))
    weight, scales = fp8_weight([48], 128)
    x = lambda rows: rand(rows, 128, dtype=HALF)  # noqa: E731
    kernels.linear(x(4), weight, None, 4, scales)
    kernels.linear(x(5), weight, None, 4, scales)
    kernels.linear(x(5), weight, None, 4, scales, w8a8_rows=16)
    kernels.linear(x(16), weight, None, 4, scales, w8a8_rows=16)
    kernels.linear(x(64), weight, None, 4, scales, w8a8_rows=16, cublas_rows=64)
    kernels.linear(x(63), weight, None, 4, scales, w8a8_rows=16, cublas_rows=64)
    kernels.linear(x(63), weight, None, 4, scales, w8a8_rows=16, fp8_mma="scaled_mm_linear")
    kernels.linear(x(1), weight, rand(48, dtype=HALF), 4, scales)  # a bias: no small-M
    kernels.gated_linear(x(2), weight, 4, scales)
    kernels.normed_linear(x(2), None, torch.ones(128, dtype=HALF), 1e-6, weight, None, 4,
                          False, scales)
    assert calls == ["linear", "dequant_linear", "dequant_linear", "w8a8_linear",
                     "cublas_linear", "w8a8_linear", "scaled_mm_linear", "dequant_linear",
                     "gated_linear", "normed_linear"]
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", False)
    if DEVICE.type == "cpu":
        calls.clear()
        rows = x(16)
        assert torch.equal(kernels.linear(rows, weight, None, 4, scales, w8a8_rows=1),
                           reference.dequant_linear(rows, weight, scales))
        assert not calls


def test_torch_block_scaled_gemm_takes_no_weight_off_an_h100():
    """``F.scaled_mm``'s block scales are sm_90's alone: a CPU weight is never given to it."""
    weight, scales = fp8_weight([256], 512)
    assert not fp8_gemm.scaled_mm_serves(weight.cpu(), scales._replace(
        inv=scales.inv.cpu(), rows=scales.rows.cpu()))
