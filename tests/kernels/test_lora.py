"""The LoRA kernels (unmerged adapters, several in one batch) against their twin, and the twin
against the per-row definition: merged projections of one to three parts, ranks of one and
several shrink tiles, sizes that fill no tile, rows grouped by slot (repeated and absent, a
slot's rows over several tiles), decode runs of one row and prefill runs longer than a row
tile, padding tiles, K split over programs; the normed input (the norm computed in the shrink)
and the gated output (the SwiGLU product in the expand); no adapter, no change."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.lora import add_lora
from hf_paged.kernels.lora_tiles import LoraTiles
from tests.kernels.conftest import DEVICE, HALF

PARTS = {1: [72], 2: [40, 40], 3: [40, 24, 24]}  # output rows a part; none a multiple of 64
DECODE = ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1])
# 70 rows: two row tiles of 64, then slot 2's other sequence: a third
PREFILL = ([70, 1, 0, 5, 9], [2, 0, 1, -1, 2])
# 60 sequences on 3 adapters (18 rows each: two tiles of 16) and none
SHARED = ([1] * 60, [-1 if i % 10 == 9 else i % 3 for i in range(60)])


def lora_case(num_parts: int, rank: int, lens: list[int], slots: list[int],
              dtype: torch.dtype, k: int = 200, adapters: int = 3) -> dict:
    """The arguments of ``add_lora``: ``adapters`` stacked, the second of a lower rank in its
    first part (zero-padded, as a stack holds it), and two rows after the batch's on no
    adapter."""
    parts = PARTS[num_parts]
    n = sum(parts)
    tokens = sum(lens) + 2
    a = torch.randn(adapters, num_parts * rank, k) / k ** 0.5
    b = torch.randn(adapters, n, rank) / rank ** 0.5
    a[1, rank // 2:rank] = 0
    b[1, :parts[0], rank // 2:] = 0
    args = dict(
        out=torch.randn(tokens, n), x=torch.randn(tokens, k), a=a, b=b,
        scaling=torch.rand(adapters, num_parts) + 0.5,
        row_part=torch.repeat_interleave(torch.arange(num_parts), torch.tensor(parts)).int(),
        tiles=LoraTiles.build([*lens, 2], [*slots, -1], DEVICE))
    for name in ("out", "x", "a", "b"):
        args[name] = args[name].to(dtype)
    return {name: v.to(DEVICE) if torch.is_tensor(v) else v for name, v in args.items()}


def with_norm(args: dict) -> dict:
    """``args`` with ``x`` the hidden state before an RMSNorm of a weight near 1."""
    x = args["x"]
    weight = (torch.rand(x.shape[1], device=DEVICE) + 0.5).to(x.dtype)
    return dict(args, x=x * 3, norm=(weight, 1e-6))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within a few roundings of the outputs' largest value in their dtype (the delta and the
    sum are each rounded to it, and their float32 sums differ in order: a rounding may fall
    the other way)."""
    tol = 1e-5 if actual.dtype == torch.float32 else 4 * torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * expected.abs().max().item())


def twin_and_kernel(args: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    expected = reference.add_lora(**dict(args, out=args["out"].clone()))
    out = args["out"].clone()
    assert add_lora(**dict(args, out=out), **kwargs) is out
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, SHARED], ids=["decode", "prefill", "shared"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_kernel_matches_twin(num_parts, rank, batch, dtype):
    out, expected = twin_and_kernel(lora_case(num_parts, rank, *batch, dtype))
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, SHARED], ids=["decode", "prefill", "shared"])
@pytest.mark.parametrize("num_parts", [1, 3])
def test_normed_input(num_parts, batch, dtype):
    """The shrink normalises the pre-norm hidden state itself, as the twin's ``rms_norm``."""
    out, expected = twin_and_kernel(with_norm(lora_case(num_parts, 16, *batch, dtype)))
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, SHARED], ids=["decode", "prefill", "shared"])
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("rank", [16, 128])
def test_gated_output(rank, normed, batch, dtype):
    """Gate/up's deltas and their SwiGLU product in one launch: every row's product, rows on
    no adapter too; the projection's output left as it was."""
    args = lora_case(2, rank, *batch, dtype)
    args = dict(with_norm(args) if normed else args, gated=True)
    start = args["out"].clone()
    expected = reference.add_lora(**args)
    assert torch.equal(args["out"], start)
    act = add_lora(**args)
    assert act.shape == (start.shape[0], start.shape[1] // 2) and torch.equal(args["out"], start)
    assert_close(act, expected)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("k,splits", [(300, 3), (256, 2), (256, None)])
@pytest.mark.parametrize("variant", [{}, {"norm": True}, {"norm": True, "gated": True}],
                         ids=["plain", "normed", "gated"])
def test_split_k(variant, k, splits, dtype):
    """K shared by several programs (the last share short, or K in whole steps), each summing
    its rows' squares over the whole of K where normed; the expand sums their partial
    products."""
    args = lora_case(2 if variant.get("gated") else 3, 16, *SHARED, dtype, k=k)
    args = dict(with_norm(args) if variant.get("norm") else args,
                gated=variant.get("gated", False))
    expected = reference.add_lora(**dict(args, out=args["out"].clone()))
    assert_close(add_lora(**args, num_splits=splits), expected)


def test_rank_128_and_padding_tiles():
    """Two shrink tiles a part; tiles past the batch's (a captured graph's bound: slot -1, no
    rows) touch nothing."""
    args = lora_case(2, 128, [3, 17, 1], [1, 0, 1], HALF)
    order, tiles, block_m = args["tiles"]
    padding = torch.tensor([[-1] * 4, [0] * 4, [0] * 4], dtype=torch.int32, device=DEVICE)
    out, expected = twin_and_kernel(
        dict(args, tiles=LoraTiles(order, torch.cat([tiles, padding], 1), block_m)))
    assert_close(out, expected)


def test_rows_of_strided_tensors():
    """x and out as column slices of wider tensors: rows a stride apart."""
    args = lora_case(2, 16, [3, 1], [1, 0], HALF)
    expected = reference.add_lora(**dict(args, out=args["out"].clone()))
    for name in ("x", "out"):
        wide = torch.zeros(args[name].shape[0], args[name].shape[1] + 24, dtype=HALF,
                           device=DEVICE)
        args[name] = wide[:, 8:8 + args[name].shape[1]].copy_(args[name])
    add_lora(**args)
    assert_close(args["out"], expected)
    assert not args["out"]._base[:, :8].any() and not args["out"]._base[:, -16:].any()


def test_no_adapter_no_change():
    args = lora_case(3, 16, [4, 1, 2], [-1, -1, -1], HALF)
    out, expected = twin_and_kernel(args)
    assert torch.equal(out, args["out"]) and torch.equal(expected, args["out"])


@pytest.mark.parametrize("num_parts", [1, 3])
def test_twin_matches_the_definition(num_parts):
    """``reference.add_lora`` against its formula, row by row in float64."""
    args = lora_case(num_parts, 16, *PREFILL, torch.float32)
    expected = args["out"].double().clone()
    a, b, part = args["a"].double(), args["b"].double(), args["row_part"].long()
    rank = args["b"].shape[2]
    cu = [0, *torch.tensor(PREFILL[0]).cumsum(0).tolist()]
    for seq, slot in enumerate(PREFILL[1]):
        for t in range(cu[seq], cu[seq + 1]) if slot >= 0 else ():
            h = (a[slot] @ args["x"][t].double()).view(num_parts, rank)
            expected[t] += args["scaling"][slot, part].double() * (h[part] * b[slot]).sum(-1)
    out = reference.add_lora(**dict(args, out=args["out"].clone()))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("fn", [reference.add_lora, add_lora], ids=["twin", "triton"])
@pytest.mark.parametrize("name,change,message", [
    ("b", lambda t: t[..., :12], "b rank capacity 12 is not a power of two"),
    ("a", lambda t: t[:, :-16], "a .* is not "),
    ("scaling", lambda t: t.half(), "scaling is torch.float16, not float32"),
    ("tiles", lambda t: t._replace(order=t.order[:-1]), "tiles order .* are not "),
    ("tiles", lambda t: t._replace(block_m=32), "tiles .* block_m 32 are not "),
    ("norm", lambda t: (torch.ones(7, device=DEVICE), 1e-6), "norm weight .* is not "),
    ("gated", lambda t: True, "gated needs two parts of equal size, not 3"),
])
def test_refuses_arguments_that_do_not_fit(fn, name, change, message):
    args = dict(lora_case(3, 16, [2, 3], [0, 1], HALF), norm=None, gated=False)
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_twin_refuses_gated_tiles_that_miss_rows():
    args = lora_case(2, 16, [2, 3], [0, 1], torch.float32)
    order, tiles, block_m = args["tiles"]
    with pytest.raises(ValueError, match="gated tiles cover 5 rows, not every one of 7"):
        reference.add_lora(**dict(args, tiles=LoraTiles(order, tiles[:, 1:], block_m)),
                           gated=True)


def test_dispatch_sends_cpu_tensors_to_triton_on_request(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    args = lora_case(3, 16, *DECODE, torch.float32)
    out, expected = args["out"].clone(), reference.add_lora(**dict(args, out=args["out"].clone()))
    assert kernels.add_lora(*dict(args, out=out).values()) is out  # dispatch on ``out``
    assert_close(out, expected)
