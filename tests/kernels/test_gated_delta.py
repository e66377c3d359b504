"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the twins against transformers' own torch functions on
a padded batch (sequences of 1, 5, 64 and 130 tokens packed by ``cu_seqlens``, two value heads
a key head, states from and to pool slots), a prefill continued across calls (split inside a
chunk and at a chunk's end), decode steps after a prefill; the Triton kernels against the twins
(float32, and half inputs with float32 states); slots of sequences not in the batch untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hf_paged.kernels import reference
from hf_paged.kernels.gated_delta import gated_delta_decode, gated_delta_prefill
from tests.kernels.conftest import DEVICE, HALF

LENS = [1, 5, 64, 130]
SLOTS = [4, 0, 2, 5]  # out of 7: slots 1, 3 and 6 belong to sequences not in the batch
INITIAL = [True, False, True, False]
KV_HEADS, HEADS, K_DIM, V_DIM = 2, 4, 32, 16


def inputs(lens: list[int], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta for ``lens`` packed (as the model makes them: ``g`` a negative log
    decay in float32, ``beta`` a sigmoid), and their ``cu_seqlens``."""
    tokens = sum(lens)
    args = dict(q=torch.randn(tokens, KV_HEADS, K_DIM), k=torch.randn(tokens, KV_HEADS, K_DIM),
                v=torch.randn(tokens, HEADS, V_DIM), beta=torch.rand(tokens, HEADS).sigmoid())
    args = {name: x.to(dtype) for name, x in args.items()}
    args["g"] = F.logsigmoid(torch.randn(tokens, HEADS) + 2)  # decays of 0.5 to 1 mostly
    args["cu_seqlens"] = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return {name: x.to(DEVICE) for name, x in args.items()}


def pool(num_slots: int = 7) -> torch.Tensor:
    return torch.randn(num_slots, HEADS, K_DIM, V_DIM, device=DEVICE) * 0.1


def prefill_args(args: dict, state_pool: torch.Tensor, slots: list[int], initial: list[bool]
                 ) -> dict:
    return dict(args, state_pool=state_pool, slots=torch.tensor(slots, dtype=torch.int32,
                                                                  device=DEVICE),
                has_initial=torch.tensor(initial, device=DEVICE))


def transformers_prefill(args: dict, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' chunked rule on the batch right-padded with zeros (rows that change no
    state), from ``states [B, H, K, V]``: the packed output and the final states."""
    cu = args["cu_seqlens"].tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    padded = {name: torch.nn.utils.rnn.pad_sequence(
        [args[name][a:b] for a, b in zip(cu, cu[1:])], batch_first=True)
        for name in ("q", "k", "v", "g", "beta")}
    out, final = torch_chunk_gated_delta_rule(
        padded["q"], padded["k"], padded["v"], g=padded["g"], beta=padded["beta"],
        initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return torch.cat([out[i, :n] for i, n in enumerate(lens)]), final


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * expected.abs().max().item())


def test_prefill_twin_matches_transformers():
    args, state_pool = inputs(LENS), pool()
    before = state_pool.clone()
    starts = torch.stack([before[s] if i else torch.zeros_like(before[s])
                          for s, i in zip(SLOTS, INITIAL)])
    expected, final = transformers_prefill(args, starts)
    out = reference.gated_delta_prefill(**prefill_args(args, state_pool, SLOTS, INITIAL))
    assert_close(out, expected, 1e-5)
    assert_close(state_pool[SLOTS], final, 1e-5)
    assert torch.equal(state_pool[[1, 3, 6]], before[[1, 3, 6]])


@pytest.mark.parametrize("split", [37, 64])
def test_prefill_continued_across_calls(split):
    """A 130-token prefill in two calls, the state carried through the pool, equals one call
    (beside a sequence that starts in the second call)."""
    whole = inputs([130])
    first = {name: whole[name][:split] for name in ("q", "k", "v", "g", "beta")}
    second = {name: whole[name][split:] for name in first}
    other = inputs([5])
    second = {name: torch.cat([second[name], other[name]]) for name in second}
    first["cu_seqlens"] = torch.tensor([0, split], dtype=torch.int32, device=DEVICE)
    second["cu_seqlens"] = torch.tensor([0, 130 - split, 135 - split], dtype=torch.int32,
                                        device=DEVICE)
    state_pool = pool()
    out1 = reference.gated_delta_prefill(**prefill_args(first, state_pool, [3], [False]))
    out2 = reference.gated_delta_prefill(**prefill_args(second, state_pool, [3, 1],
                                                        [True, False]))
    zeros = torch.zeros(1, HEADS, K_DIM, V_DIM, device=DEVICE)
    expected, final = transformers_prefill(whole, zeros)
    assert_close(torch.cat([out1, out2[:130 - split]]), expected, 1e-5)
    assert_close(state_pool[3], final[0], 1e-5)
    expected_other, final_other = transformers_prefill(other, zeros)
    assert_close(out2[130 - split:], expected_other, 1e-5)
    assert_close(state_pool[1], final_other[0], 1e-5)


def test_decode_twin_after_prefill_matches_transformers():
    """Three decode steps after a prefill, with a padding row (slot -1) in the batch: each
    equals transformers' recurrent rule from the state its chunked rule left."""
    lens, slots = [5, 70], [6, 2]
    args, state_pool = inputs(lens), pool()
    reference.gated_delta_prefill(**prefill_args(args, state_pool, slots, [False, False]))
    _, states = transformers_prefill(args, torch.zeros(2, HEADS, K_DIM, V_DIM, device=DEVICE))
    before = state_pool.clone()
    for _ in range(3):
        step = inputs([1, 1, 1])
        step.pop("cu_seqlens")
        out = reference.gated_delta_decode(
            **step, state_pool=state_pool,
            slots=torch.tensor([slots[0], -1, slots[1]], dtype=torch.int32, device=DEVICE))
        rows = {name: x[[0, 2], None] for name, x in step.items()}  # [B, 1, ...]
        expected, states = torch_recurrent_gated_delta_rule(
            rows["q"], rows["k"], rows["v"], g=rows["g"], beta=rows["beta"],
            initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(out[[0, 2]], expected[:, 0], 1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(state_pool[slots], states, 1e-5)
    assert torch.equal(state_pool[[0, 1, 3, 4, 5]], before[[0, 1, 3, 4, 5]])


def kernel_and_twin(kernel, twin, args: dict) -> None:
    """Run both on copies of the pool; outputs and every slot within the dtype's tolerance
    (float32: products summed in another order; half inputs: the TF32 products of a GPU)."""
    pools = args["state_pool"], args["state_pool"].clone()
    out = kernel(**args)
    expected = twin(**dict(args, state_pool=pools[1]))
    tol = 1e-4 if args["q"].dtype == torch.float32 else 2e-3
    assert_close(out, expected, tol)
    assert_close(pools[0], pools[1], tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_prefill_kernel_matches_twin(dtype):
    args = prefill_args(inputs(LENS, dtype), pool(), SLOTS, INITIAL)
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_prefill, reference.gated_delta_prefill, args)
    assert torch.equal(args["state_pool"][[1, 3, 6]], before[[1, 3, 6]])


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_kernel_matches_twin(dtype):
    step = inputs([1] * 4, dtype)
    step.pop("cu_seqlens")
    slots = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=DEVICE)
    args = dict(step, state_pool=pool(), slots=slots)
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_decode, reference.gated_delta_decode, args)
    assert torch.equal(args["state_pool"][[1, 2, 4, 6]], before[[1, 2, 4, 6]])
