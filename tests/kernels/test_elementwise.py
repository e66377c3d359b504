"""RMSNorm (plain, fused residual add, per-head on strided views), RoPE and SiLU-and-mul."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.activation import silu_and_mul
from hf_paged.kernels.rmsnorm import add_rms_norm, rms_norm
from hf_paged.kernels.rotary import rope
from tests.kernels.conftest import DEVICE, HALF, assert_close

DTYPES = [torch.float32, HALF]


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm(dtype, hidden):
    x, weight = rand(7, hidden, dtype=dtype), rand(hidden, dtype=dtype)
    assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_view(dtype):
    # Qwen3's q_norm: [T, H, D] heads of a fused qkv projection, normalised over D.
    tokens, heads, head_dim = 5, 4, 32
    qkv = rand(tokens, 2 * heads * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = rand(head_dim, dtype=dtype)
    out = rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    assert_close(out, reference.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(dtype):
    x, residual, weight = rand(9, 96, dtype=dtype), rand(9, 96, dtype=dtype), rand(96, dtype=dtype)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    assert normed is x and new_residual is residual
    assert_close(new_residual, expected_residual)
    assert_close(normed, expected_normed)


def test_rms_norm_wide_weight_promotes_like_reference():
    x, weight = rand(3, 64, dtype=HALF), rand(64, dtype=torch.float32)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    assert_close(out, reference.rms_norm(x, weight, 1e-6))


def cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
    freqs = torch.arange(max_positions, device=DEVICE)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 6)])
def test_rope_in_place_on_strided_views(dtype, heads, kv_heads):
    tokens, head_dim = 11, 64
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v_before = v.clone()
    positions = torch.randint(0, 500, (tokens,), device=DEVICE)
    cache = cos_sin_cache(512, head_dim)
    expected_q, expected_k = reference.rope(q, k, positions, cache)
    out_q, out_k = rope(q, k, positions, cache)
    assert out_q is q and out_k is k
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2 * 1500), (2, 3, 2 * 64)])
def test_silu_and_mul(dtype, shape):
    x = rand(*shape, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, reference.silu_and_mul(x))


@pytest.mark.gpu
def test_real_shapes_bf16():
    bf16 = torch.bfloat16
    x, residual = rand(256, 4096, dtype=bf16), rand(256, 4096, dtype=bf16)
    weight = rand(4096, dtype=bf16)
    expected = reference.add_rms_norm(x, residual, weight, 1e-6)
    for got, want in zip(add_rms_norm(x, residual, weight, 1e-6), expected):
        assert_close(got, want)
    q, k = rand(256, 32, 128, dtype=bf16), rand(256, 8, 128, dtype=bf16)
    positions, cache = torch.randint(0, 4096, (256,), device=DEVICE), cos_sin_cache(4096, 128)
    for got, want in zip(rope(q.clone(), k.clone(), positions, cache),
                         reference.rope(q, k, positions, cache)):
        assert_close(got, want)
    gate_up = rand(256, 2 * 12288, dtype=bf16)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
