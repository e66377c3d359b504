"""RMSNorm (plain, fused residual add, per-head on strided views), SiLU-and-mul, the fused
per-head norm + RoPE + KV store of the attention inputs, and the embedding with pending tokens."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.activation import silu_and_mul
from hf_paged.kernels.attention_inputs import norm_rope_store
from hf_paged.kernels.embedding import embed
from hf_paged.kernels.rmsnorm import add_rms_norm, rms_norm
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
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_in_place(dtype, offset):
    x, residual, weight = rand(9, 96, dtype=dtype), rand(9, 96, dtype=dtype), rand(96, dtype=dtype)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5,
                                                                offset)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5, offset)
    assert normed is x and new_residual is residual
    assert_close(new_residual, expected_residual)
    assert_close(normed, expected_normed)


def test_rms_norm_wide_weight_promotes_like_reference():
    x, weight = rand(3, 64, dtype=HALF), rand(64, dtype=torch.float32)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    assert_close(out, reference.rms_norm(x, weight, 1e-6))


def test_zero_centred_rms_norm_is_transformers_and_keeps_the_input_dtype():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    x, weight = rand(5, 64, dtype=HALF), rand(64, dtype=torch.float32)
    norm = Qwen3NextRMSNorm(64, eps=1e-6).to(DEVICE)
    norm.weight.data.copy_(weight)
    expected = norm(x).detach()
    for out in (rms_norm(x, weight, 1e-6, offset=True),
                reference.rms_norm(x, weight, 1e-6, offset=True)):
        assert out.dtype == HALF
        assert_close(out, expected)


def cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
    freqs = torch.arange(max_positions, device=DEVICE)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def attention_inputs(tokens, heads, kv_heads, head_dim, page, num_blocks, dtype,
                     rotary=None):
    """q, k, v as strided views of one fused projection (as the attention layer passes them),
    norm weights, positions, a RoPE table (of ``rotary`` dimensions: partial RoPE), NaN-filled
    caches and slots with padding rows."""
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    weights = [1 + 0.1 * rand(head_dim, dtype=dtype) for _ in range(2)]
    positions = torch.randint(0, 500, (tokens,), device=DEVICE)
    caches = [torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype,
                         device=DEVICE) for _ in range(2)]
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:tokens]
    slots[::5] = -1  # padding rows: not stored
    table = cos_sin_cache(512, rotary or head_dim)
    return qkv, (q, k, v, *weights, 1e-6, positions, table, *caches, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page,rotary,offset", [
    (4, 2, 64, 16, None, False), (6, 6, 48, 8, None, False),
    (4, 2, 64, 16, 16, True),  # Qwen3-Next's: a quarter of each head rotates, offset norms
    (3, 1, 48, 8, 24, False), (2, 2, 32, 8, None, True)])
def test_norm_rope_store_in_place(dtype, heads, kv_heads, head_dim, page, rotary, offset):
    qkv, args = attention_inputs(11, heads, kv_heads, head_dim, page, 4, dtype, rotary)
    q, k, v = args[:3]
    v_before = v.clone()
    expected_caches = [c.clone() for c in args[8:10]]
    ref_args = (*[a.clone() for a in args[:3]], *args[3:8], *expected_caches, args[10])
    expected_q, expected_k = reference.norm_rope_store(*ref_args, offset=offset)
    out_q, out_k = norm_rope_store(*args, offset=offset)
    assert out_q is q and out_k is k
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(v, v_before)
    for got, want in zip(args[8:10], expected_caches):
        # Untouched slots stay NaN on both sides: nothing else was written.
        assert got.isnan().equal(want.isnan()) and got.isnan().any()
        assert_close(got.nan_to_num(), want.nan_to_num())


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
    _, args = attention_inputs(256, 16, 8, 128, 16, 40, bf16)
    ref_args = (*[a.clone() for a in args[:3]], *args[3:8], *[c.clone() for c in args[8:10]],
                args[10])
    for got, want in zip(norm_rope_store(*args), reference.norm_rope_store(*ref_args)):
        assert_close(got, want)
    for got, want in zip(args[8:10], ref_args[8:10]):
        assert_close(got.nan_to_num(), want.nan_to_num())
    gate_up = rand(256, 2 * 12288, dtype=bf16)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_start", [0, 40])
def test_embed_with_pending_tokens(dtype, vocab_start):
    # A rank's slice of 40 tokens of an 80-token vocabulary, hidden 1,100 (two column blocks,
    # the second partial); rows with src >= 0 take last_tokens[src], as a decode graph's pending
    # tokens; ids views at an odd offset of an int32 buffer, as a graph's packed inputs.
    weight = rand(40, 1100, dtype=dtype)
    packed = torch.tensor([0, 3, 45, 79, 41, 10, 60, 2], dtype=torch.int32, device=DEVICE)
    ids = packed[1:7]
    src = torch.tensor([-1, -1, 2, -1, 0, -1], dtype=torch.int32, device=DEVICE)
    last = torch.tensor([44, 7, 5, 62], dtype=torch.int64, device=DEVICE)
    for args in ((), (src, last)):
        got = embed(ids, weight, vocab_start, *args)
        want = reference.embed(ids, weight, vocab_start, *args)
        assert torch.equal(got, want)
    tokens = torch.where(src >= 0, last[src.clamp(min=0)], ids)
    local = tokens - vocab_start
    for row, token in enumerate(local.tolist()):
        expected = weight[token] if 0 <= token < 40 else torch.zeros_like(weight[0])
        assert torch.equal(want[row], expected)
