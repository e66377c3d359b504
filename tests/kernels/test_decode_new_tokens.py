"""Decode attention that computes the newest token's inputs itself (``new_tokens``): per-head
RMSNorm and RoPE of the raw query and key, the key and value stored in the cache, against
``reference.norm_rope_store`` then ``reference.paged_attention``."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.attention import paged_attention
from hf_paged.kernels.reference import NewTokens
from tests.kernels.conftest import DEVICE, HALF, assert_close
from tests.kernels.test_paged_attention import DECODE_LENS, paged_batch


def check(seq_lens, heads, kv_heads, head_dim, page, dtype=torch.float32, **hints):
    raw_q, k_cache, v_cache, cu, lens, tables = paged_batch(
        seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, page, dtype)
    gen = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
    key, value = (rand(len(seq_lens), kv_heads, head_dim).to(dtype) for _ in range(2))
    q_weight, k_weight = ((1 + 0.3 * rand(head_dim)).to(dtype) for _ in range(2))
    positions = (lens - 1).clamp(min=0)
    cos_sin = rand(max(seq_lens) + 1, head_dim)
    # The newest token's slot (-1 for padded rows); NaN there until the kernel stores it.
    slots = torch.tensor([int(tables[b, (n - 1) // page]) * page + (n - 1) % page if n else -1
                          for b, n in enumerate(seq_lens)], device=DEVICE)
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]] = float("nan")
    new = NewTokens(key, value, q_weight, k_weight, 1e-6, positions, cos_sin, slots)
    expected_caches = k_cache.float(), v_cache.float()
    out = paged_attention(raw_q, k_cache, v_cache, cu, lens, tables, head_dim**-0.5,
                          max_query_len=1, new_tokens=new, **hints)
    real = torch.tensor(seq_lens, device=DEVICE) > 0
    real_cu = torch.arange(int(real.sum()) + 1, dtype=torch.int32, device=DEVICE)
    as_float = NewTokens(key[real].float(), value[real].float(), q_weight.float(),
                         k_weight.float(), 1e-6, positions[real], cos_sin, slots[real])
    expected = reference.paged_attention(raw_q[real].float(), *expected_caches, real_cu,
                                         lens[real], tables[real], head_dim**-0.5, as_float)
    assert_close(out[real], expected)
    assert out[~real].isfinite().all()
    for cache, want in zip((k_cache, v_cache), expected_caches):
        assert_close(cache.nan_to_num(), want.nan_to_num())  # at the cache dtype's tolerance


@pytest.mark.parametrize("page,group", [(8, 1), (16, 2), (32, 4)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_new_tokens_decode(page, group, num_splits):
    check(DECODE_LENS, 2 * group, 2, 32, page, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_new_tokens_padded_graph_rows(num_splits):
    check([0, 12, 0, 40, 0], 4, 2, 32, 8, num_splits=num_splits)


def test_new_tokens_half_precision():
    check(DECODE_LENS, 4, 2, 64, 16, HALF, num_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_new_tokens_real_shapes(batch):
    lens = torch.randint(900, 1100, (batch,)).tolist()
    check(lens, 16, 8, 128, 16, torch.bfloat16)
