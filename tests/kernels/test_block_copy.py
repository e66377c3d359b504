"""The batched copy-on-write block copy against its reference."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.block_copy import copy_blocks
from tests.kernels.conftest import DEVICE, HALF


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", [(9, 8, 2, 16), (6, 16, 3, 40)])  # one chunk / several
def test_copy_blocks_matches_reference(dtype, shape):
    k = torch.randn(shape, device=DEVICE).to(dtype)
    v = torch.randn(shape, device=DEVICE).to(dtype)
    src = torch.tensor([0, 3, 3], device=DEVICE)  # one source copied twice
    dst = torch.tensor([5, 1, 4], device=DEVICE)
    expected_k, expected_v = k.clone(), v.clone()
    reference.copy_blocks(expected_k, expected_v, src, dst)
    copy_blocks(k, v, src, dst)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert torch.equal(k[5], k[0]) and torch.equal(v[4], v[3])


@pytest.mark.gpu
def test_copy_blocks_at_the_real_shape():
    """Qwen3-0.6B's cache blocks (16 tokens x 8 KV heads x 128) in bf16, 256 copies at once."""
    k = torch.randn(2048, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    src = torch.randperm(1024, device=DEVICE)[:256]
    dst = torch.randperm(1024, device=DEVICE)[:256] + 1024
    expected_k, expected_v = k.clone(), v.clone()
    reference.copy_blocks(expected_k, expected_v, src, dst)
    copy_blocks(k, v, src, dst)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
