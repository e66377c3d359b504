"""The Gated DeltaNet layers' gated RMSNorm: the twin against transformers' own modules, the
Triton kernel against the twin (rows, and per-head rows of strided views)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from hf_paged.kernels import reference
from hf_paged.kernels.gated_norm import gated_rms_norm
from tests.kernels.conftest import DEVICE, HALF, assert_close

# (input dtype, weight dtype): a model's own dtype, and a float32 weight under 16-bit inputs.
DTYPES = [(torch.float32, torch.float32), (HALF, HALF), (HALF, torch.float32)]


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("module", [Qwen3NextRMSNormGated, Qwen3_5RMSNormGated])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_twin_is_transformers(module, dtype, weight_dtype):
    norm = module(32, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    norm.to(weight_dtype or dtype)
    x, z = rand(6, 4, 32, dtype=dtype) * 3, rand(6, 4, 32, dtype=dtype)
    with torch.no_grad():
        expected = norm(x, z)
    out = reference.gated_rms_norm(x, z, norm.weight.detach(), 1e-6)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype, weight_dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100])
def test_triton_rows(dtype, weight_dtype, dim):
    x, z = rand(7, dim, dtype=dtype), rand(7, dim, dtype=dtype)
    weight = rand(dim, dtype=weight_dtype)
    out = gated_rms_norm(x, z, weight, 1e-6)
    assert out.dtype == dtype
    assert_close(out, reference.gated_rms_norm(x, z, weight, 1e-6))


@pytest.mark.parametrize("dtype, weight_dtype", DTYPES)
def test_triton_per_head_on_strided_views(dtype, weight_dtype):
    # The attention output [T, H, D] and its gate z, a slice of the wider input projection.
    tokens, heads, head_dim = 5, 4, 32
    x = rand(tokens, heads, head_dim, dtype=dtype)
    z = rand(tokens, 3 * heads * head_dim, dtype=dtype)[:, heads * head_dim:2 * heads * head_dim]
    z = z.view(tokens, heads, head_dim)
    weight = rand(head_dim, dtype=weight_dtype)
    out = gated_rms_norm(x, z, weight, 1e-6)
    assert out.shape == x.shape
    assert_close(out, reference.gated_rms_norm(x, z, weight, 1e-6))


@pytest.mark.parametrize("twin", [reference.gated_rms_norm, gated_rms_norm])
def test_gate_of_another_shape_is_named(twin):
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="gated_rms_norm: z "):
        twin(x, torch.zeros(3, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
