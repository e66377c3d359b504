"""The Gated DeltaNet gates' kernel (the log decay ``g`` and ``beta`` of every token and value
head, one launch) against its twin, which is transformers' expression: ``a`` and ``b`` strided
views of one fused projection, as Qwen3.5's layer reads them, with ``a + dt_bias`` on both
sides of softplus's threshold; ``A_log`` in float32 and in the model's dtype; shapes named."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.delta_gates import gated_delta_gates
from tests.kernels.conftest import DEVICE, HALF


def gate_inputs(rows: int, heads: int, dtype: torch.dtype, a_log_dtype: torch.dtype):
    torch.manual_seed(rows * heads)
    fused = torch.randn(rows, 3 * heads + 5, device=DEVICE) * 8
    if rows:  # a + dt_bias well above softplus's threshold (20) and far below zero
        fused[0, 5:7] = torch.tensor([30.0, -40.0])
    fused = fused.to(dtype)
    a, b = fused[:, 5:5 + heads], fused[:, 5 + heads:5 + 2 * heads]
    a_log = torch.linspace(-3, 2, heads, device=DEVICE).to(a_log_dtype)
    dt_bias = torch.rand(heads, device=DEVICE).to(dtype)
    return a, b, a_log, dt_bias


@pytest.mark.parametrize("rows,heads", [(1, 32), (37, 4), (300, 8)])
@pytest.mark.parametrize("dtype,a_log_dtype", [(torch.float32, torch.float32),
                                               (HALF, torch.float32), (HALF, HALF)])
def test_gates_match_twin(rows, heads, dtype, a_log_dtype):
    args = gate_inputs(rows, heads, dtype, a_log_dtype)
    g, beta = gated_delta_gates(*args)
    g_ref, beta_ref = reference.gated_delta_gates(*args)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    above = (args[0].float() + args[3].float()) > 20
    assert above.any() and not above.all()  # both branches of softplus
    # float32 exp and log against torch's: a few ulps of each gate
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6 * g_ref.abs().max().item())
    # float32 sigmoids a few ulps apart (exp's error and the division's; 2.2 at most over 40
    # seeds), each rounded once to beta's dtype: in half precision at most one step apart
    steps = 4 if dtype == torch.float32 else 2
    step = steps * torch.finfo(dtype).eps * beta_ref.float().abs()
    assert ((beta.float() - beta_ref.float()).abs() <= step).all()


def test_no_rows():
    g, beta = gated_delta_gates(*gate_inputs(0, 4, torch.float32, torch.float32))
    assert g.shape == beta.shape == (0, 4)


@pytest.mark.parametrize("fn", [gated_delta_gates, reference.gated_delta_gates],
                         ids=["kernel", "twin"])
def test_mismatched_shapes_are_named(fn):
    a, b, a_log, dt_bias = gate_inputs(3, 4, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"gated_delta_gates: a \(3, 4\), b \(3, 3\)"):
        fn(a, b[:, :3], a_log, dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias \(5,\)"):
        fn(a, b, a_log, torch.zeros(5, device=DEVICE))
