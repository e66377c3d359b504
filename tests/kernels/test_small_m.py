"""The small-M projection kernel (decode at small batches) against ``F.linear``: every row count up
to the limit, sizes that fill no block evenly, wide and long weights, rows of a strided batch,
the gated (SwiGLU) variant, and the dispatch that sends a projection to it only up to its chosen
row count; and RMSNorm fused in front of both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.small_m import MAX_ROWS, gated_linear, linear, normed_linear
from tests.kernels.conftest import DEVICE, HALF, assert_close


def rand(*shape, dtype):
    return (torch.randn(*shape, device=DEVICE) / shape[-1] ** 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(48, 64), (100, 300)])
def test_linear(dtype, rows, n, k):
    x, weight = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype)
    assert_close(linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("inter,k", [(48, 64), (50, 300)])
def test_gated_linear(rows, inter, k):
    """The merged gate/up projection's SwiGLU product, rounded as the unfused ops round."""
    x, weight = rand(rows, k, dtype=HALF), rand(2 * inter, k, dtype=HALF)
    assert_close(gated_linear(x, weight), reference.silu_and_mul(F.linear(x, weight)))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,k", [(1, 64), (3, 300), (2, 1100), (1, 2100)])
def test_normed_linear(gated, with_residual, rows, k):
    """RMSNorm (after the residual add) fused into the projection: the same output and new
    residual as the norm kernel's twin then the projection, the inputs left as they were."""
    x, weight = rand(rows, k, dtype=HALF), rand(2 * 24, k, dtype=HALF)
    residual = rand(rows, k, dtype=HALF) if with_residual else None
    norm = (1 + torch.randn(k, device=DEVICE) / 4).to(HALF)
    inputs = [t for t in (x, residual) if t is not None]
    before = [t.clone() for t in inputs]
    out, new_residual = normed_linear(x, residual, norm, 1e-6, weight, gated)
    if with_residual:
        normed, expected_residual = reference.add_rms_norm(x.clone(), residual.clone(), norm, 1e-6)
    else:
        normed, expected_residual = reference.rms_norm(x, norm, 1e-6), x
    expected = F.linear(normed, weight)
    assert_close(out, reference.silu_and_mul(expected) if gated else expected)
    assert torch.equal(new_residual, expected_residual)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))


def test_wide_and_long_weights():
    """Four-row strips (4,096 outputs and more) and several 1,024-column steps along K."""
    x, weight = rand(2, 1100, dtype=HALF), rand(4100, 1100, dtype=HALF)
    assert_close(linear(x, weight), F.linear(x, weight))


def test_rows_of_a_strided_batch():
    x = rand(4, 2 * 64, dtype=HALF)[:, :64]  # row stride 128
    weight = rand(32, 64, dtype=HALF)
    assert_close(linear(x, weight), F.linear(x, weight))


def test_dispatch_takes_the_kernel_only_up_to_the_chosen_rows(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    monkeypatch.setattr(kernels, "_triton_kernel", lambda module, name: (
        (lambda *a, **k: a[0]) if module == "rmsnorm" else (lambda *a, **k: name)))
    weight = rand(32, 64, dtype=HALF)
    assert kernels.linear(rand(4, 64, dtype=HALF), weight, small_m_rows=4) == "linear"
    assert kernels.gated_linear(rand(4, 64, dtype=HALF), weight, small_m_rows=4) == "gated_linear"
    # more rows than chosen: the projection, then silu_and_mul
    assert kernels.gated_linear(rand(5, 64, dtype=HALF), weight, small_m_rows=4) == "silu_and_mul"
    norm = torch.ones(64, dtype=HALF)
    assert kernels.normed_linear(rand(2, 64, dtype=HALF), None, norm, 1e-6, weight,
                                 small_m_rows=4) == "normed_linear"
    # the norm apart (start-up's choice): the norm's launch, then the small-M kernel
    out, _ = kernels.normed_linear(rand(2, 64, dtype=HALF), None, norm, 1e-6, weight,
                                   small_m_rows=4, fuse=False)  # (the norm patched to pass x)
    assert out == "linear"
    for x, rows, bias in [(rand(5, 64, dtype=HALF), 4, None),  # more rows than chosen
                          (rand(1, 64, dtype=HALF), 0, None),  # not chosen at all
                          (rand(1, 64, dtype=HALF), 4, rand(32, dtype=HALF))]:  # a bias
        assert isinstance(kernels.linear(x, weight, bias, small_m_rows=rows), torch.Tensor)
