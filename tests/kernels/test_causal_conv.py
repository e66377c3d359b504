"""The Gated DeltaNet convolution over packed sequences and a state pool: the twin against
transformers' own path (its torch ``causal_conv1d_fn`` / ``causal_conv1d_update`` and the
cache layer its models make), the Triton kernels against the twin."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

from hf_paged.kernels import reference
from hf_paged.kernels.causal_conv import causal_conv_decode, causal_conv_prefill
from tests.kernels.conftest import DEVICE, HALF, assert_close

WIDTH, CHANNELS = 4, 24
LENGTHS = [1, 2, 3, 7, 40]
FAMILIES = [modeling_qwen3_next, modeling_qwen3_5]


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def packed(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([0] + [len(c) for c in chunks])
    return torch.cat(chunks), lens.cumsum(0).to(torch.int32).to(DEVICE)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def flags(values: list[bool]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool, device=DEVICE)


class TransformersConv:
    """One sequence through the convolution as the GatedDeltaNet forward runs it with a cache:
    a one-token step on an existing state through ``causal_conv1d_update``, anything else
    through the cache's ``update_conv_state`` and ``causal_conv1d_fn`` (torch paths)."""

    def __init__(self, family, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        config = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"],
                                 linear_conv_kernel_dim=weight.shape[1])
        self.layer = DynamicCache(config=config).layers[0]
        self.weight, self.bias = weight, bias
        self.fn = inspect.unwrap(family.causal_conv1d_fn)
        self.update = inspect.unwrap(family.causal_conv1d_update)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        hidden, state = x.T[None], self.layer.conv_states[0]
        if state is not None and x.shape[0] == 1:
            out = self.update(hidden, state, self.weight, self.bias, "silu")
        else:
            full = self.layer.update_conv_state(hidden, 0, conv_kernel_size=self.weight.shape[1])
            out = self.fn(full, self.weight, self.bias, activation="silu")[..., -x.shape[0]:]
        return out[0].T

    @property
    def state(self) -> torch.Tensor:
        """``[C, kernel_size]``, oldest first."""
        return self.layer.conv_states[0][0]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda m: m.__name__.split("_", 1)[1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("state_len", [WIDTH - 1, WIDTH])
def test_packed_prefill_then_decode_match_transformers(family, bias, state_len):
    weight, b = rand(CHANNELS, WIDTH), rand(CHANNELS) if bias else None
    seqs = [TransformersConv(family, weight, b) for _ in LENGTHS]
    pool = rand(9, CHANNELS, state_len)
    untouched = pool.clone()
    slots = int32([6, 2, 0, 8, 4])
    new = flags([False] * len(LENGTHS))
    chunks = [rand(n, CHANNELS) for n in LENGTHS]
    x, cu = packed(chunks)
    out = reference.causal_conv_prefill(x, weight, b, cu, pool, slots, new)
    assert_close(out, torch.cat([seq(c) for seq, c in zip(seqs, chunks, strict=True)]))
    for _ in range(3):
        step = rand(len(LENGTHS), CHANNELS)
        out = reference.causal_conv_decode(step, weight, b, pool, slots)
        assert_close(out, torch.cat([seq(row[None]) for seq, row in zip(seqs, step, strict=True)]))
        for seq, slot in zip(seqs, slots.tolist(), strict=True):
            # transformers keeps kernel_size inputs; a pool of fewer keeps its last ones.
            assert_close(pool[slot], seq.state[:, WIDTH - state_len:])
    others = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(pool[others], untouched[others])


def test_twin_is_the_layers_convolution(monkeypatch):
    # Qwen3.5's GatedDeltaNet forward with its cache (a prefill in two chunks, then one-token
    # steps), its convolution's outputs recorded where the forward calls it.
    config = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1,
                               layer_types=["linear_attention"], linear_num_key_heads=2,
                               linear_key_head_dim=8, linear_num_value_heads=4,
                               linear_value_head_dim=8)
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, 0).to(DEVICE)
    recorded = []

    def recording(function):
        def record(*args, **kwargs):
            recorded.append(function(*args, **kwargs))
            return recorded[-1]
        return record

    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(modeling_qwen3_5, name, recording(getattr(modeling_qwen3_5, name)))
    cache = DynamicCache(config=config)
    weight = layer.conv1d.weight.detach().squeeze(1)
    pool = torch.zeros(2, weight.shape[0], weight.shape[1], device=DEVICE)
    slot = int32([1])
    hidden = rand(1, 12, config.hidden_size)
    with torch.no_grad():
        for start, end in ((0, 5), (5, 9), (9, 10), (10, 11), (11, 12)):
            layer(hidden[:, start:end], cache=cache)
            x = layer.in_proj_qkv(hidden[0, start:end])
            if start >= 9:
                out = reference.causal_conv_decode(x, weight, None, pool, slot)
            else:
                out = reference.causal_conv_prefill(x, weight, None, int32([0, end - start]),
                                                    pool, slot, flags([start > 0]))
            assert_close(out, recorded[-1][0, :, start - end:].T)
    assert len(recorded) == 5
    assert_close(pool[1], cache.layers[0].conv_states[0][0])


@pytest.mark.parametrize("split", [1, 2, 5, 38, 39])
def test_prefill_split_over_two_calls(split):
    # The second call continues from the state the first left, as one call does, and as
    # transformers' cache does for a prefill in chunks.
    weight, bias = rand(CHANNELS, WIDTH), rand(CHANNELS)
    x = rand(40, CHANNELS)
    whole, parts = (torch.zeros(3, CHANNELS, WIDTH, device=DEVICE) for _ in "ab")
    slot, new, old = int32([1]), flags([False]), flags([True])
    args = weight, bias
    expected = reference.causal_conv_prefill(x, *args, int32([0, 40]), whole, slot, new)
    first = reference.causal_conv_prefill(x[:split], *args, int32([0, split]), parts, slot, new)
    second = reference.causal_conv_prefill(x[split:], *args, int32([0, 40 - split]), parts, slot,
                                           old)
    assert_close(torch.cat([first, second]), expected)
    assert torch.equal(parts, whole)
    seq = TransformersConv(modeling_qwen3_next, weight, bias)
    assert_close(torch.cat([seq(x[:split]), seq(x[split:])]), expected)
    assert_close(parts[1], seq.state)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("state_len, bias", [(WIDTH - 1, False), (WIDTH, True)])
def test_triton_matches_reference(dtype, state_len, bias):
    channels = 200  # two channel blocks, the second partial
    weight, b = rand(channels, WIDTH, dtype=dtype), rand(channels, dtype=dtype) if bias else None
    pool = rand(10, channels, state_len, dtype=dtype)
    # A strided view (a slice of a wider projection), an empty sequence, a padding slot (-1)
    # and two padding rows past the last sequence.
    lens = [1, 2, 3, 0, 7, 40, 5]
    slots = int32([7, 2, 9, 5, 0, 4, -1])
    has_initial = flags([True, False, True, True, True, False, True])
    x = rand(sum(lens) + 2, channels + 16, dtype=dtype)[:, 8:channels + 8]
    cu = int32([0, *lens]).cumsum(0).to(torch.int32)
    expected_pool = pool.clone()
    expected = reference.causal_conv_prefill(x, weight, b, cu, expected_pool, slots, has_initial)
    out = causal_conv_prefill(x, weight, b, cu, pool, slots, has_initial)
    assert_close(out, expected)
    assert torch.equal(pool, expected_pool)  # copies: every other slot untouched as well
    for _ in range(2):
        step = rand(len(lens), channels, dtype=dtype)
        expected = reference.causal_conv_decode(step, weight, b, expected_pool, slots)
        assert_close(causal_conv_decode(step, weight, b, pool, slots), expected)
        assert torch.equal(pool, expected_pool)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_decode_of_first_tokens_starts_from_zeros(dtype):
    """One token a sequence where some start (``has_initial`` False): those read zeros, not
    their slot, as a one-row prefill does; the Triton kernel agrees."""
    weight, pool = rand(CHANNELS, WIDTH, dtype=dtype), rand(4, CHANNELS, WIDTH, dtype=dtype)
    step, slots = rand(3, CHANNELS, dtype=dtype), int32([2, 0, -1])
    has_initial = flags([False, True, False])
    prefill_pool, twin_pool = pool.clone(), pool.clone()
    expected = reference.causal_conv_prefill(step, weight, None, int32([0, 1, 2, 3]),
                                             prefill_pool, slots, has_initial)
    twin = reference.causal_conv_decode(step, weight, None, twin_pool, slots,
                                        has_initial=has_initial)
    assert_close(twin, expected)
    assert torch.equal(twin_pool, prefill_pool)
    assert_close(causal_conv_decode(step, weight, None, pool, slots, has_initial=has_initial),
                 expected)
    assert torch.equal(pool, prefill_pool)


def test_triton_inputs_wider_than_the_weight():
    # transformers casts the inputs to the weight's dtype for the convolution, the result back.
    weight, bias = rand(CHANNELS, WIDTH, dtype=HALF), rand(CHANNELS, dtype=HALF)
    x, step = rand(9, CHANNELS) * 3, rand(2, CHANNELS) * 3
    cu, slots, has_initial = int32([0, 4, 9]), int32([2, 0]), flags([False, True])
    pool = rand(3, CHANNELS, WIDTH)
    expected_pool = pool.clone()
    expected = reference.causal_conv_prefill(x, weight, bias, cu, expected_pool, slots,
                                             has_initial)
    out = causal_conv_prefill(x, weight, bias, cu, pool, slots, has_initial)
    assert out.dtype == torch.float32
    assert_close(out.to(HALF), expected.to(HALF))  # computed in the weight's precision
    assert torch.equal(pool, expected_pool)
    expected = reference.causal_conv_decode(step, weight, bias, expected_pool, slots)
    assert_close(causal_conv_decode(step, weight, bias, pool, slots).to(HALF), expected.to(HALF))
    assert torch.equal(pool, expected_pool)


def test_triton_no_activation_one_row_and_no_rows():
    weight, x = rand(CHANNELS, WIDTH), rand(1, CHANNELS)
    pool, expected_pool = (torch.zeros(2, CHANNELS, WIDTH, device=DEVICE) for _ in "ab")
    args = int32([0, 1]), int32([1]), flags([False])
    expected = reference.causal_conv_prefill(x, weight, None, args[0], expected_pool, *args[1:],
                                             activation=None)
    assert_close(causal_conv_prefill(x, weight, None, args[0], pool, *args[1:], activation=None),
                 expected)
    assert torch.equal(pool, expected_pool)
    # No rows: a new sequence's slot is cleared all the same.
    pool.fill_(1.0)
    expected_pool.fill_(1.0)
    for twin, target in ((reference.causal_conv_prefill, expected_pool),
                         (causal_conv_prefill, pool)):
        assert twin(x[:0], weight, None, int32([0, 0]), target, *args[1:]).shape == (0, CHANNELS)
    assert torch.equal(pool, expected_pool)
    assert not pool[1].any() and pool[0].eq(1).all()


@pytest.mark.parametrize("change, message", [
    (dict(weight=torch.zeros(CHANNELS + 1, WIDTH)), "weight"),
    (dict(conv_pool=torch.zeros(2, CHANNELS, WIDTH - 2)), "conv_pool"),
    (dict(conv_pool=torch.zeros(2, CHANNELS, WIDTH, dtype=torch.float16)), "conv_pool"),
    (dict(slots=torch.zeros(1, dtype=torch.int64)), "slots"),
    (dict(cu_seqlens=torch.tensor([0, 3, 3], dtype=torch.int32)), "cu_seqlens"),
    (dict(activation="gelu"), "activation"),
])
@pytest.mark.parametrize("twin", [reference.causal_conv_prefill, causal_conv_prefill])
def test_bad_arguments_are_named(twin, change, message):
    args = dict(x=torch.zeros(3, CHANNELS), weight=torch.zeros(CHANNELS, WIDTH), bias=None,
                cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
                conv_pool=torch.zeros(2, CHANNELS, WIDTH), slots=torch.zeros(1, dtype=torch.int32),
                has_initial=torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match=f"causal_conv_prefill: {message} "):
        twin(**{**args, **change})
