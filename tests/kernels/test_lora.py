"""The LoRA kernels (unmerged adapters, several in one batch) against their twin, and the twin
against the per-row definition: merged projections of one to three parts, ranks of one and
several shrink tiles, sizes that fill no tile, slots repeated and absent, decode runs of one row
and prefill runs longer than a row tile, K split over programs; no adapter, no change."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import reference
from hf_paged.kernels.lora import add_lora
from tests.kernels.conftest import DEVICE, HALF

PARTS = {1: [72], 2: [40, 40], 3: [40, 24, 24]}  # output rows a part; none a multiple of 64
DECODE = ([1, 1, 1, 1, 1], [0, -1, 2, 0, 1])
PREFILL = ([70, 1, 0, 5, 9], [2, 0, 1, -1, 2])  # 70 rows: two row tiles of 64


def lora_case(num_parts: int, rank: int, lens: list[int], slots: list[int],
              dtype: torch.dtype, k: int = 200, adapters: int = 3) -> dict:
    """The arguments of ``add_lora``: ``adapters`` stacked, the second of a lower rank in its
    first part (zero-padded, as a stack holds it), and two padding rows after the batch."""
    parts = PARTS[num_parts]
    n = sum(parts)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    tokens = int(cu[-1]) + 2
    a = torch.randn(adapters, num_parts * rank, k) / k ** 0.5
    b = torch.randn(adapters, n, rank) / rank ** 0.5
    a[1, rank // 2:rank] = 0
    b[1, :parts[0], rank // 2:] = 0
    args = dict(
        out=torch.randn(tokens, n), x=torch.randn(tokens, k), a=a, b=b,
        scaling=torch.rand(adapters, num_parts) + 0.5,
        row_part=torch.repeat_interleave(torch.arange(num_parts), torch.tensor(parts)),
        cu_seqlens=cu, slots=torch.tensor(slots), max_rows=max(lens))
    for name in ("out", "x", "a", "b"):
        args[name] = args[name].to(dtype)
    for name in ("row_part", "slots"):
        args[name] = args[name].to(torch.int32)
    return {name: v.to(DEVICE) if torch.is_tensor(v) else v for name, v in args.items()}


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
@pytest.mark.parametrize("batch", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_kernel_matches_twin(num_parts, rank, batch, dtype):
    out, expected = twin_and_kernel(lora_case(num_parts, rank, *batch, dtype))
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("k,splits", [(300, 3), (256, 2), (256, None)])
def test_split_k(k, splits, dtype):
    """K shared by several programs (the last share short, or K in whole steps); the expand
    sums their partial products."""
    out, expected = twin_and_kernel(lora_case(3, 16, *DECODE, dtype, k=k), num_splits=splits)
    assert_close(out, expected)


def test_rank_128_and_an_overstated_row_bound():
    """Two shrink tiles a part; a grid for longer runs than the batch has (a captured graph's
    bound) touches nothing more."""
    args = lora_case(2, 128, [3, 17, 1], [1, 0, 1], HALF)
    out, expected = twin_and_kernel(dict(args, max_rows=100))
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
    cu, rank = args["cu_seqlens"].tolist(), args["b"].shape[2]
    for seq, slot in enumerate(args["slots"].tolist()):
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
    ("cu_seqlens", lambda t: t[:-1], "cu_seqlens .* is not "),
])
def test_refuses_arguments_that_do_not_fit(fn, name, change, message):
    args = lora_case(2, 16, [2, 3], [0, 1], HALF)
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_dispatch_sends_cpu_tensors_to_triton_on_request(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", True)
    args = lora_case(3, 16, *DECODE, torch.float32)
    out, expected = args["out"].clone(), reference.add_lora(**dict(args, out=args["out"].clone()))
    assert kernels.add_lora(*dict(args, out=out).values()) is out  # dispatch on ``out``
    assert_close(out, expected)
