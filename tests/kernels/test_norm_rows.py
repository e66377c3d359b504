"""The RMSNorm kernels' blocks of rows: each program normalises ``ROWS`` (row, head) pairs of a
``[rows, heads, D]`` view, ``ROWS`` chosen from ``D``. Pair counts that leave the last block
partial, head dims giving several ``ROWS`` (and one not a power of two), and the layouts the
models pass: contiguous, the heads of a wider fused projection, heads with gaps between them.
Stores must stay inside the view: the rest of a fused buffer is checked untouched."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.gated_norm import gated_rms_norm
from hf_paged.kernels.rmsnorm import add_rms_norm, rms_norm, row_block
from tests.kernels.conftest import DEVICE, HALF, assert_close

DIMS = [64, 96, 128, 1024, 2048]
# (rows, heads): 1, 12, 17 and 1,056 pairs, the first three short of every ROWS above one.
SHAPES = [(1, 1), (3, 4), (17, 1), (33, 32)]
LAYOUTS = ["contiguous", "fused", "gapped"]
OPS = ["rms_norm", "add_rms_norm", "add_rms_norm_offset", "gated_rms_norm"]


def view_of(base: torch.Tensor, heads: int, dim: int, layout: str) -> torch.Tensor:
    """The ``[rows, heads, dim]`` view of ``base`` (made by ``base_for``) in ``layout``."""
    if layout == "fused":  # the middle third of a projection's output, as q of a fused qkv
        return base[:, heads * dim:2 * heads * dim].view(-1, heads, dim)
    if layout == "gapped":
        return base[..., :dim]
    return base


def base_for(rows: int, heads: int, dim: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    shape = {"contiguous": (rows, heads, dim), "fused": (rows, 3 * heads * dim),
             "gapped": (rows, heads, dim + 16)}[layout]
    return torch.randn(shape, device=DEVICE).to(dtype)


def cases():
    for dim in DIMS:
        for rows, heads in SHAPES:
            # The interpreter runs programs one by one: the widest rows only at small counts.
            if dim * rows * heads <= 1 << 17 or (rows, heads) == (33, 32) and dim <= 128:
                yield dim, rows, heads


def test_cases_cover_several_row_blocks_and_partial_ones():
    blocks = {dim: row_block(dim)[1] for dim in DIMS}
    assert len(set(blocks.values())) >= 4 and 1 in blocks.values()
    for dim, block in blocks.items():
        counts = [rows * heads for d, rows, heads in cases() if d == dim]
        assert any(n % block for n in counts) or block == 1
        assert any(n > block for n in counts)


@pytest.mark.parametrize("dim, rows, heads", list(cases()))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("op", OPS)
def test_row_blocks_match_the_reference(op, dtype, layout, dim, rows, heads):
    x_base = base_for(rows, heads, dim, layout, dtype)
    other_base = base_for(rows, heads, dim, layout, dtype)  # the residual, or the gate
    inside = torch.zeros(x_base.shape, dtype=torch.bool, device=DEVICE)
    view_of(inside, heads, dim, layout).fill_(True)
    x, other = view_of(x_base, heads, dim, layout), view_of(other_base, heads, dim, layout)
    weight = torch.randn(dim, device=DEVICE).to(dtype)
    before = x_base.clone(), other_base.clone()

    if op == "rms_norm":
        outs = [rms_norm(x, weight, 1e-6)]
        expected = [reference.rms_norm(x, weight, 1e-6)]
    elif op == "gated_rms_norm":
        outs = [gated_rms_norm(x, other, weight, 1e-6)]
        expected = [reference.gated_rms_norm(x, other, weight, 1e-6)]
    else:
        offset = op.endswith("offset")
        expected = reference.add_rms_norm(x.clone(), other.clone(), weight, 1e-6, offset)
        outs = add_rms_norm(x, other, weight, 1e-6, offset)
        assert outs[0] is x and outs[1] is other
    for got, want in zip(outs, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want)
    for base, old in zip((x_base, other_base), before):
        assert torch.equal(base[~inside], old[~inside])
