"""The small-M projection kernels (decode at small batches) against ``F.linear`` and
``F.linear`` then ``silu_and_mul``: every row count up to the limit, sizes that fill no block
evenly, and rows of a strided batch."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.small_m import MAX_ROWS, gated_linear, linear
from tests.kernels.conftest import DEVICE, HALF, assert_close


def rand(*shape, dtype):
    return (torch.randn(*shape, device=DEVICE) / shape[-1] ** 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(48, 64), (100, 300)])
def test_linear(dtype, rows, n, k):
    x, weight = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype)
    assert_close(linear(x, weight), reference.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, MAX_ROWS])
def test_gated_linear(dtype, rows):
    inter, k = 40, 96
    x, weight = rand(rows, k, dtype=dtype), rand(2 * inter, k, dtype=dtype)
    out = gated_linear(x, weight)
    assert out.shape == (rows, inter)
    assert_close(out, reference.gated_linear(x, weight))


def test_rows_of_a_strided_batch():
    x = rand(4, 2 * 64, dtype=HALF)[:, :64]  # row stride 128
    weight = rand(32, 64, dtype=HALF)
    assert_close(linear(x, weight), reference.linear(x, weight))


def test_dispatch_takes_the_kernel_only_for_a_few_half_precision_rows(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    monkeypatch.setattr(kernels, "_triton_kernel", lambda module, name: lambda *a: name)
    half, weight = rand(MAX_ROWS, 64, dtype=HALF), rand(32, 64, dtype=HALF)
    assert kernels.linear(half, weight) == "linear"
    assert kernels.gated_linear(half, weight) == "gated_linear"
    many = rand(MAX_ROWS + 1, 64, dtype=HALF)
    single = rand(MAX_ROWS, 64, dtype=torch.float32)
    for x in (many, single):
        assert isinstance(kernels.linear(x, weight.to(x.dtype)), torch.Tensor)
    bias = rand(32, dtype=HALF)
    assert isinstance(kernels.linear(half, weight, bias), torch.Tensor)
