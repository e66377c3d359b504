"""The FP8 KV cache's kernels: the store (quantize) and the attention reads (dequantize) of the
Triton kernels against their reference twins, and the twins against a direct definition of
e4m3 rounding. On the GPU when there is one, else under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.attention import paged_attention
from hf_paged.kernels.attention_inputs import norm_rope_store
from hf_paged.kernels.block_copy import copy_blocks
from hf_paged.kernels.decode_attention import decode_splits
from tests.kernels.conftest import DEVICE, HALF, assert_close
from tests.kernels.test_elementwise import attention_inputs
from tests.kernels.test_paged_attention import DECODE_LENS, paged_batch

FP8 = torch.float8_e4m3fn


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from its bit patterns, ascending."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    return values[values.isfinite()].unique()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scales(kv_heads: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head scales spread over two orders of magnitude: values land on normal and
    subnormal e4m3 numbers and some saturate."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((10 ** (-2 + 2 * torch.rand(kv_heads, generator=gen))).to(DEVICE)
                 for _ in "kv")


def test_quantize_kv_is_nearest_e4m3_of_the_scaled_value_saturated():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 8, generator=gen) * torch.tensor([0.5, 20.0, 1e3])[None, :, None]
    scale = torch.tensor([0.01, 0.1, 1.0])
    got = reference.quantize_kv(x, scale).float()
    grid = e4m3_values()
    scaled = (x / scale[:, None]).clamp(-448, 448)
    nearest = grid[(scaled[..., None] - grid).abs().argmin(-1)]
    # argmin takes the lower of two equidistant values, rounding-to-even may take the upper:
    # only exact midpoints may differ, and random data has none.
    assert torch.equal(got, nearest)
    assert got.abs().max() == 448  # the large head saturates
    back = reference.dequantize_kv(reference.quantize_kv(x, scale), scale, torch.float32)
    # Normal numbers round to within 1/16 of the value; the subnormals' step is 2**-9.
    bound = torch.maximum(x.abs() / 16, 2.0**-10 * scale[:, None]) * 1.0001
    unsaturated = (x / scale[:, None]).abs() < 448
    assert ((back - x).abs() <= bound)[unsaturated].all()


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_norm_rope_store_quantizes_as_the_reference(dtype):
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    _, args = attention_inputs(11, heads, kv_heads, head_dim, page, 4, dtype)
    caches = [torch.full(c.shape, float("nan"), device=DEVICE).to(FP8) for c in args[8:10]]
    k_scale, v_scale = scales(kv_heads)
    expected = [c.clone() for c in caches]
    ref_q, ref_k = reference.norm_rope_store(*[a.clone() for a in args[:3]], *args[3:8],
                                             *expected, args[10], k_scale, v_scale)
    q, k = norm_rope_store(*args[:8], *caches, args[10], k_scale, v_scale)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    for got, want in zip(caches, expected):
        assert torch.equal(bits(got), bits(want))
        assert got.float().isnan().any()  # untouched slots


def fp8_batch(seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype, shared=0):
    """``paged_batch`` with its caches quantized (unused slots stay NaN) and their scales."""
    query, k_cache, v_cache, cu, lens, tables = paged_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, page, torch.float32, shared=shared)
    k_scale, v_scale = scales(kv_heads)
    k8, v8 = (reference.quantize_kv(c.flatten(0, 1), s).view(c.shape)
              for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    return query.to(dtype), k8, v8, cu, lens, tables, k_scale, v_scale


def check(seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype=torch.float32, shared=0,
          **hints):
    """The Triton kernel over an FP8 cache against the float32 reference over the same."""
    query, k8, v8, cu, lens, tables, k_scale, v_scale = fp8_batch(
        seq_lens, q_lens, heads, kv_heads, head_dim, page, dtype, shared)
    if shared:
        hints["shared_prefix"] = torch.tensor([shared * page], dtype=torch.int32, device=DEVICE)
    out = paged_attention(query, k8, v8, cu, lens, tables, head_dim**-0.5, k_scale=k_scale,
                          v_scale=v_scale, **hints)
    expected = reference.paged_attention(query.float(), k8, v8, cu, lens, tables,
                                         head_dim**-0.5, k_scale, v_scale)
    # Scales to the outputs' size: values up to 448 times the value scale.
    tol = (1e-4 if dtype == torch.float32 else 1e-2) * float(expected.abs().max())
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_over_fp8_cache(num_splits, dtype):
    n = len(DECODE_LENS)
    check(DECODE_LENS, [1] * n, 4, 2, 32, 16, dtype, max_query_len=1, num_splits=num_splits)


def test_fp8_decode_split_rule_aims_at_four_programs_per_sm():
    """The measured FP8 split factors (``decode_splits``' docstring) on a 132-SM device: none
    from about four programs per SM, fewer than the bf16 tile's below that, never more than the
    table's tiles."""
    cpu = torch.device("cpu")  # acts as 132 SMs
    seqs = (8, 16, 32, 64, 256)
    assert [decode_splits(n * 8, 64, cpu, fp8=True) for n in seqs] == [8, 4, 2, 1, 1]
    assert [decode_splits(n * 8, 64, cpu) for n in seqs] == [12, 6, 3, 2, 1]
    assert decode_splits(8, 3, cpu, fp8=True) == 3


@pytest.mark.parametrize("page", [64, 128])  # the FP8 decode tile's 128 keys within a block
def test_decode_over_fp8_cache_in_large_blocks(page):
    lens = [1, 100, 127, 128, 129, 300]
    check(lens, [1] * len(lens), 4, 2, 32, page, HALF, max_query_len=1)
    check(lens, lens, 4, 2, 32, page)


def test_decode_cascade_over_fp8_cache():
    lens = [70, 75, 81, 90]
    check(lens, [1] * 4, 4, 2, 32, 16, shared=3, max_query_len=1, num_splits=2)


def test_prefill_and_chunks_over_fp8_cache():
    check([5, 40, 33], [5, 17, 1], 4, 2, 32, 8, max_query_len=17)


def test_copy_blocks_copies_fp8_bytes():
    k, v = (torch.randn(6, 8, 2, 16, device=DEVICE).to(FP8) for _ in "kv")
    src, dst = torch.tensor([0, 3], device=DEVICE), torch.tensor([5, 1], device=DEVICE)
    expected_k, expected_v = k.clone(), v.clone()
    reference.copy_blocks(expected_k, expected_v, src, dst)
    copy_blocks(k, v, src, dst)
    assert torch.equal(bits(k), bits(expected_k)) and torch.equal(bits(v), bits(expected_v))
    assert torch.equal(bits(k[5]), bits(k[0])) and torch.equal(bits(v[1]), bits(v[3]))


def test_norm_rope_store_keeps_the_sign_of_values_rounding_to_zero():
    """A value too small for e4m3 at its scale is stored as a zero of its own sign, as torch's
    cast stores it (values go to the cache as they are; keys after their norm and RoPE)."""
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    _, args = attention_inputs(11, heads, kv_heads, head_dim, page, 4, torch.float32)
    v = args[2]
    v.copy_(torch.where(torch.arange(v.numel(), device=DEVICE).view(v.shape) % 2 == 0, -1e-9,
                        1e-9))
    caches = [torch.full(c.shape, float("nan"), device=DEVICE).to(FP8) for c in args[8:10]]
    k_scale, v_scale = scales(kv_heads)
    expected = [c.clone() for c in caches]
    reference.norm_rope_store(*[a.clone() for a in args[:3]], *args[3:8], *expected, args[10],
                              k_scale, v_scale)
    norm_rope_store(*args[:8], *caches, args[10], k_scale, v_scale)
    assert (bits(expected[1]) == 0x80).any()  # the reference keeps -0
    assert torch.equal(bits(caches[1]), bits(expected[1]))
