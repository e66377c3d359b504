"""The grouped MoE GEMMs on block-quantized FP8 experts against the reference (which
dequantizes, then runs the plain path): dimensions that are not multiples of the 128-wide
scale blocks, a gate/up grid whose up part starts mid-block, K steps shorter than a scale
block, decode and several alignment chunks; and the arguments refused by name."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.block_scales import BlockScales, grid_rows
from hf_paged.kernels.moe_gemm import moe_experts
from hf_paged.kernels.moe_tiles import MoEConfig, moe_config
from tests.kernels.conftest import DEVICE, HALF, assert_close
from tests.kernels.test_moe import routing

BLOCK = 128
# (tokens, experts, top_k, hidden, intermediate): hidden and intermediate cut scale blocks short
SHAPES = [
    (1, 8, 2, 160, 72),  # decode; the up rows start inside the gate's last block
    (5, 6, 2, 136, 200),  # intermediate over one block, experts no power of two
    (40, 8, 4, 96, 48),  # 160 pairs: two alignment chunks; single, short blocks
]


def fp8_experts(experts: int, hidden: int, inter: int, block: int = BLOCK
                ) -> tuple[torch.Tensor, BlockScales, torch.Tensor, BlockScales]:
    """Random float8_e4m3fn ``w13`` and ``w2`` with scale grids of ``block``-square blocks as
    a checkpoint stores them: gate and up each with their own grid rows (stacked), down with
    one grid."""
    def grid(rows: int, cols: int) -> torch.Tensor:
        # scales of about 1 / (64 sqrt(K)): outputs of order one for values of order 64
        cells = (experts, rows, -(-cols // block))
        return (0.5 + torch.rand(cells, device=DEVICE)) / (64 * cols ** 0.5)

    def values(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device=DEVICE) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    w13, w2 = values(experts, 2 * inter, hidden), values(experts, hidden, inter)
    part = -(-inter // block)
    s13 = BlockScales(grid(2 * part, hidden), grid_rows([inter, inter], block, DEVICE), block)
    s2 = BlockScales(grid(-(-hidden // block), inter), grid_rows([hidden], block, DEVICE),
                     block)
    return w13, s13, w2, s2


def activations(tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Of order one, as the experts' inputs after the norm (outputs of order one too)."""
    return torch.randn(tokens, hidden, device=DEVICE).to(dtype)


def case(shape: tuple[int, ...], dtype: torch.dtype, block: int = BLOCK) -> dict:
    """``moe_experts``' arguments for ``shape`` (tokens, experts, top_k, hidden, intermediate):
    activations, FP8 experts with ``block``-square scale blocks, and a routing."""
    tokens, experts, top_k, hidden, inter = shape
    w13, s13, w2, s2 = fp8_experts(experts, hidden, inter, block)
    weights, ids = routing(tokens, experts, top_k, dtype)
    return dict(x=activations(tokens, hidden, dtype), w13=w13, w2=w2, weights=weights, ids=ids,
                w13_scales=s13, w2_scales=s2)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_experts(dtype, shape):
    args = case(shape, dtype)
    want = reference.moe_experts(**args)
    assert want.abs().max() > 0.1  # scales that keep the outputs away from zero
    assert_close(moe_experts(**args), want)


@pytest.mark.parametrize("tokens", [1, 40])
def test_fp8_experts_of_narrower_blocks(tokens):
    """64-wide scale blocks, narrower than the default tiles' K step: the tiles step within
    one scale column (a checkpoint of weight_block_size [64, 64])."""
    args = case((tokens, 6, 2, 160, 72), HALF, block=64)
    assert_close(moe_experts(**args), reference.moe_experts(**args))


def test_fp8_short_k_steps_and_narrow_tiles():
    """Four K steps per scale block, N tiles that split the gate/up grid rows."""
    args = case((6, 4, 2, 200, 72), HALF)
    config = MoEConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4,
                       num_stages=2)
    assert_close(moe_experts(**args, config=config), reference.moe_experts(**args))


def test_fp8_unused_experts_are_not_read():
    """NaN in the weights and scales of every expert no token picks leaves the output
    unchanged."""
    args = case((2, 8, 2, 64, 40), HALF)
    want = moe_experts(**args)
    unused = sorted(set(range(8)) - set(args["ids"].flatten().tolist()))
    for tensor in (args["w13"], args["w2"], args["w13_scales"].inv, args["w2_scales"].inv):
        tensor[unused] = float("nan")
    assert torch.equal(moe_experts(**args), want)


def test_fp8_arguments_refused_by_name():
    args = case((2, 4, 2, 64, 32), HALF)
    x, w13, w2, weights, ids = (args[k] for k in ("x", "w13", "w2", "weights", "ids"))
    s13, s2 = args["w13_scales"], args["w2_scales"]
    with pytest.raises(ValueError, match="w13_scales and w2_scales"):
        moe_experts(x, w13, w2, weights, ids, w13_scales=s13)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_experts(x, w13.to(HALF), w2.to(HALF), weights, ids, w13_scales=s13, w2_scales=s2)
    with pytest.raises(ValueError, match="block_k"):
        moe_experts(x, w13, w2, weights, ids, w13_scales=s13._replace(block_k=48),
                    w2_scales=s2._replace(block_k=48))
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x, w13, w2, weights, ids, w13_scales=s13,
                    w2_scales=s2._replace(rows=s2.rows[:-1]))


def test_fp8_dispatch_takes_the_reference_on_cpu_tensors(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", False)
    x = torch.randn(3, 144)
    w13, s13, w2, s2 = (t.cpu() if isinstance(t, torch.Tensor) else
                        BlockScales(t.inv.cpu(), t.rows.cpu(), t.block_k)
                        for t in fp8_experts(4, 144, 24))
    weights, ids = kernels.moe_route(torch.randn(3, 4), 2, True)
    assert torch.equal(
        kernels.moe_experts(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2),
        reference.moe_experts(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2))


def test_fp8_tiles_step_within_a_scale_block():
    """Every default tile for FP8 experts takes K steps that divide the 128-column scale
    blocks; decode takes narrower N tiles than bf16."""
    for tokens in (1, 16, 64, 256, 2048, 8192):
        for n, k in ((768, 2048), (72, 160), (24, 32)):
            for dtype in (torch.float32, torch.bfloat16):
                assert BLOCK % moe_config(tokens, 128, 8, n, k, dtype, fp8=True).block_k == 0
    assert moe_config(1, 128, 8, 768, 2048, torch.bfloat16, fp8=True).block_n == 32

