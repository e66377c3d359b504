"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the twins against transformers' own torch functions on
a padded batch (sequences of 1, 5, 64 and 130 tokens packed by ``cu_seqlens``, two value heads
a key head, q/k/v strided views of one projection, states from and to pool slots), a prefill
continued across calls (split inside a chunk and at a chunk's end), decode steps after a
prefill; the Triton kernels against the twins (float32, and half inputs with float32 states;
more sequences than the prefill's chunk kernel reads at once;
without the L2 norm, with a scale) and, alone, a continued prefill then decode against
transformers; slots of sequences not in the batch, and of padding rows and sequences,
untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hf_paged.kernels import gated_delta_chunked, reference
from hf_paged.kernels.gated_delta import gated_delta_decode
from hf_paged.kernels.gated_delta_chunked import gated_delta_prefill
from tests.kernels.conftest import DEVICE, HALF

LENS = [1, 5, 64, 130]
SLOTS = [4, 0, 2, 5]  # out of 7: slots 1, 3 and 6 belong to sequences not in the batch
INITIAL = [True, False, True, False]
SIZES = 2, 4, 32, 16  # key heads, value heads, key and value head dims
_, HEADS, K_DIM, V_DIM = SIZES


def inputs(lens: list[int], dtype: torch.dtype = torch.float32,
           sizes: tuple[int, int, int, int] = SIZES) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta for ``lens`` packed, as the model makes them: q, k, v views of one
    projection's rows (strided), ``g`` a negative log decay in float32, ``beta`` a sigmoid;
    and their ``cu_seqlens``. ``sizes``: key heads, value heads, key and value head dims."""
    kv_heads, heads, k_dim, v_dim = sizes
    tokens = sum(lens)
    widths = [kv_heads * k_dim, kv_heads * k_dim, heads * v_dim]
    q, k, v = torch.randn(tokens, sum(widths)).to(DEVICE, dtype).split(widths, dim=1)
    return dict(q=q.view(tokens, kv_heads, k_dim), k=k.view(tokens, kv_heads, k_dim),
                v=v.view(tokens, heads, v_dim),
                g=F.logsigmoid(torch.randn(tokens, heads) + 2).to(DEVICE),  # decays 0.5-1 mostly
                beta=torch.randn(tokens, heads).sigmoid().to(DEVICE, dtype),
                cu_seqlens=torch.tensor([0, *lens]).cumsum(0).to(DEVICE, torch.int32))


def pool(num_slots: int = 7, sizes: tuple[int, int, int, int] = SIZES) -> torch.Tensor:
    _, heads, k_dim, v_dim = sizes
    return torch.randn(num_slots, heads, k_dim, v_dim, device=DEVICE) * 0.1


def prefill_args(args: dict, state_pool: torch.Tensor, slots: list[int], initial: list[bool]
                 ) -> dict:
    return dict(args, state_pool=state_pool, slots=torch.tensor(slots, dtype=torch.int32,
                                                                  device=DEVICE),
                has_initial=torch.tensor(initial, device=DEVICE))


def decode_args(args: dict, slots: list[int], state_pool: torch.Tensor | None = None) -> dict:
    args = {name: x for name, x in args.items() if name != "cu_seqlens"}
    return dict(args, state_pool=pool() if state_pool is None else state_pool,
                slots=torch.tensor(slots, dtype=torch.int32, device=DEVICE))


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
        step = decode_args(inputs([1, 1, 1]), [slots[0], -1, slots[1]], state_pool)
        out = reference.gated_delta_decode(**step)
        rows = {name: step[name][[0, 2], None] for name in ("q", "k", "v", "g", "beta")}
        expected, states = torch_recurrent_gated_delta_rule(
            rows["q"], rows["k"], rows["v"], g=rows["g"], beta=rows["beta"],
            initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(out[[0, 2]], expected[:, 0], 1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(state_pool[slots], states, 1e-5)
    assert torch.equal(state_pool[[0, 1, 3, 4, 5]], before[[0, 1, 3, 4, 5]])


def kernel_and_twin(kernel, twin, args: dict) -> None:
    """Run both on copies of the pool; outputs and every slot within the dtype's tolerance
    (float32: products summed in another order; half inputs: the TF32 products of a GPU, and a
    half output one rounding step of its dtype apart where the two float32 sums straddle it)."""
    pools = args["state_pool"], args["state_pool"].clone()
    out = kernel(**args)
    expected = twin(**dict(args, state_pool=pools[1]))
    tol = 1e-4 if args["q"].dtype == torch.float32 else 2e-3
    assert_close(out, expected, tol + (torch.finfo(out.dtype).eps if out.dtype != torch.float32
                                       else 0.0))
    assert_close(pools[0], pools[1], tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_prefill_kernel_matches_twin(dtype):
    args = prefill_args(inputs(LENS, dtype), pool(), SLOTS, INITIAL)
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_prefill, reference.gated_delta_prefill, args)
    assert torch.equal(args["state_pool"][[1, 3, 6]], before[[1, 3, 6]])


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_a_prefill_sequence_on_a_negative_slot_starts_from_zeros_and_keeps_nothing(dtype):
    """A CUDA graph's padding sequences (empty) and a -1 slot amid others."""
    args = prefill_args(inputs([5, 0, 64, 0], dtype), pool(), [4, -1, 2, -1], [True] * 4)
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_prefill, reference.gated_delta_prefill, args)
    assert torch.equal(args["state_pool"][[0, 1, 3, 5, 6]], before[[0, 1, 3, 5, 6]])
    args = prefill_args(inputs([70], dtype), pool(), [-1], [True])
    zeros = prefill_args(args, pool(), [0], [False])
    assert_close(gated_delta_prefill(**args), reference.gated_delta_prefill(**zeros), 2e-3)


def test_prefill_kernel_finds_each_chunks_sequence_past_one_block_of_sequences(monkeypatch):
    """More sequences than the chunk kernel reads at once (64 in use, 2 here), one empty:
    every chunk maps to its own sequence and offset."""
    monkeypatch.setattr(gated_delta_chunked, "_SEQ_BLOCK", 2)
    args = prefill_args(inputs([1, 5, 0, 64, 130]), pool(), [4, 0, 1, 2, 5],
                        [True, False, True, True, False])
    kernel_and_twin(gated_delta_prefill, reference.gated_delta_prefill, args)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_kernel_matches_twin(dtype):
    args = decode_args(inputs([1] * 4, dtype), [5, -1, 0, 3])
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_decode, reference.gated_delta_decode, args)
    assert torch.equal(args["state_pool"][[1, 2, 4, 6]], before[[1, 2, 4, 6]])


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_of_first_tokens_starts_from_zeros(dtype):
    """A step of one token a sequence may start sequences (one-token prompts): where
    ``has_initial`` is False the decode rule ignores the slot's state, as the prefill twin
    does, and both kernels agree."""
    args = dict(decode_args(inputs([1] * 4, dtype), [5, -1, 0, 3]),
                has_initial=torch.tensor([False, True, True, False], device=DEVICE))
    kernel_and_twin(gated_delta_decode, reference.gated_delta_decode, args)
    fresh = {name: args[name][[0, 3]] for name in ("q", "k", "v", "g", "beta")}
    prefill_pool = args["state_pool"].clone()
    expected = reference.gated_delta_prefill(**prefill_args(
        dict(fresh, cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)),
        prefill_pool, [5, 3], [False, False]))
    out = reference.gated_delta_decode(**args)
    assert_close(out[[0, 3]], expected, 1e-4 if dtype == torch.float32 else 2e-3)


def test_kernels_continue_a_prefill_then_decode():
    """The Triton kernels alone: a 100-token prefill in two calls (split inside a chunk),
    then two decode steps, against transformers' rules over the whole sequence."""
    whole, state_pool = inputs([100]), pool()
    expected, states = transformers_prefill(whole, torch.zeros(1, HEADS, K_DIM, V_DIM,
                                                               device=DEVICE))
    for rows, initial in ((slice(0, 37), False), (slice(37, 100), True)):
        part = {name: whole[name][rows] for name in ("q", "k", "v", "g", "beta")}
        part["cu_seqlens"] = torch.tensor([0, rows.stop - rows.start], dtype=torch.int32,
                                          device=DEVICE)
        out = gated_delta_prefill(**prefill_args(part, state_pool, [2], [initial]))
        assert_close(out, expected[rows], 1e-4)
    for _ in range(2):
        step = decode_args(inputs([1]), [2], state_pool)
        out = gated_delta_decode(**step)
        expected, states = torch_recurrent_gated_delta_rule(
            *(step[name][:, None] for name in ("q", "k", "v")), g=step["g"][:, None],
            beta=step["beta"][:, None], initial_state=states, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        assert_close(out, expected[:, 0], 1e-4)
    assert_close(state_pool[2], states[0], 1e-4)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_kernels_without_l2norm_and_with_a_scale(decode):
    """Keys of norm below one (the delta rule's condition without the normalisation)."""
    args = inputs([1] * 3 if decode else [70, 3])
    args["k"] = args["k"] / K_DIM ** 0.5
    args = (decode_args(args, [1, 4, 0]) if decode
            else prefill_args(args, pool(), [1, 4], [True, False]))
    kernel, twin = ((gated_delta_decode, reference.gated_delta_decode) if decode
                    else (gated_delta_prefill, reference.gated_delta_prefill))
    kernel_and_twin(kernel, twin, dict(args, use_qk_l2norm=False, scale=0.3))


def test_bad_arguments_are_named():
    args = prefill_args(inputs([3]), pool(), [0], [False])
    with pytest.raises(ValueError, match="gated_delta_prefill: g .* float32"):
        reference.gated_delta_prefill(**dict(args, g=args["g"].half()))
    with pytest.raises(ValueError, match="gated_delta_decode: state_pool"):
        gated_delta_decode(**decode_args(inputs([1] * 3), [0, 1, 2], pool()[:, :, :8]))
