from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.kv_write import store_kv
from tests.kernels.conftest import DEVICE, HALF


@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_store_kv_matches_reference(page, dtype):
    tokens, kv_heads, head_dim, num_blocks = 23, 2, 48, 6
    # key/value: strided views into a fused projection, as the attention layer passes them.
    fused = torch.randn(tokens, 3, kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:tokens]
    slots[::5] = -1  # padding tokens: skipped
    caches = [torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype,
                         device=DEVICE) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    # Untouched slots stay NaN on both sides: equal_nan checks nothing else was written.
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)
    assert caches[0].isnan().any()


@pytest.mark.gpu
def test_store_kv_real_shape():
    tokens, kv_heads, head_dim, page = 1000, 8, 128, 16
    key = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(80 * page, device=DEVICE)[:tokens]
    caches = [torch.zeros(80, page, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
              for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
