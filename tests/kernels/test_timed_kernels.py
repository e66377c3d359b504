"""The kernels start-up times per projection group (``worker/projection_tuning``,
``worker/fp8_tuning``) compute the same thing, as the model computes it there: a plain, a
gated (SwiGLU) and a normed group (the RMSNorm and residual add before the projection: its
own launch before the GEMM, fused into the small-M kernel or its own launch before it), 16-bit
and block-quantized FP8."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels.block_scales import BlockScales, grid_rows, quantize
from hf_paged.worker.fp8_tuning import _kernels
from hf_paged.worker.projection_tuning import timed_kernels, timed_variants
from tests.kernels.conftest import DEVICE, HALF, assert_close


@pytest.mark.parametrize("kind", ["", "gated", "normed", "gated normed", "lm_head"])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_timed_kernels_of_a_group_agree(kind, fp8):
    gen = torch.Generator().manual_seed(3)
    n, k, rows = 2 * 96, 256, 2
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, HALF)
    name = f"{n}x{k} {'fp8 ' if fp8 else ''}{kind}".strip()
    if fp8:
        q, inv = quantize(weight, (128, 128))
        w = (q, BlockScales(inv, grid_rows([n], 128, DEVICE), 128))
        run = _kernels("gated" in kind.split())
        variants = lambda name: timed_variants(name, run["dequant"], run["small_m"], x)  # noqa: E731
    else:
        w = weight.to(HALF)
        variants = lambda name: timed_kernels(name, x)  # noqa: E731

    def output(kernel: str, name: str = name) -> torch.Tensor:
        """One variant's output from fresh inputs: the same random residual (seeded), and the
        norm's launch writes in place of its inputs on the GPU, as in the model."""
        torch.manual_seed(7)
        return variants(name)[kernel](x.clone(), w)

    normed = "normed" in kind.split()
    assert sorted(variants(name)) == sorted(["other", "small_m"] + ["small_m_apart"] * normed)
    expected = output("other")
    for kernel in ("small_m", "small_m_apart")[:1 + normed]:
        assert_close(output(kernel), expected)
    if normed:  # the norm is really there
        unnormed = output("other", name.replace(" normed", ""))
        assert not torch.allclose(expected.float(), unnormed.float(), atol=1e-2)
