"""The Gated DeltaNet layers' short causal depthwise convolution over a packed batch, with each
sequence's last inputs in a slot of a state pool: prefill (chunks continuing from the slot, or
new sequences) and one-token decode. Twins of ``reference_conv``; grids from shapes only.

A prefill is two launches: every row's output in tiles of rows (a row finds its sequence by a
binary search of ``cu_seqlens``, so tiles need no per-sequence grid), then the slots' new
states, once every row has read the old ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_conv import check_conv

_BLOCK_T = 16
_BLOCK_C = 128


@triton.jit
def _in_weight_dtype(values, w_ptr):
    """Inputs as ``F.conv1d`` takes them, cast to the weight's dtype (then float32 to sum)."""
    return values.to(w_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _activate(acc, w_dtype: tl.constexpr, SILU: tl.constexpr):
    """The convolution's sum rounded to the weight's dtype (``F.conv1d``'s result), then the
    SiLU in float32 (rounded again by the caller's store)."""
    out = acc.to(w_dtype).to(tl.float32)
    if SILU:
        out = out / (1.0 + tl.exp(-out))
    return out


@triton.jit
def _conv_rows_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, pool_ptr, cu_ptr, slots_ptr, init_ptr,
    tokens, channels, batch, x_s0, x_s1, w_s0, w_s1, o_s0, p_s0, p_s1, p_s2,
    STATE_LEN: tl.constexpr, WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    # The row's sequence: the last i in 0..batch with cu_seqlens[i] <= row (batch: padding).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + batch
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_ptr + mid) <= rows
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    live = (rows < tokens) & (lo < batch)
    start = tl.load(cu_ptr + lo, mask=live, other=0)
    slot = tl.load(slots_ptr + lo, mask=live, other=-1)
    initial = live & (tl.load(init_ptr + lo, mask=live, other=0) != 0) & (slot >= 0)
    slot = slot.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        src = rows - (WIDTH - 1 - k)
        from_x = src >= start
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_s0 + cols[None, :] * x_s1,
                     mask=(live & from_x)[:, None] & cmask[None, :], other=0.0)
        # Before its start, a row's window reads the last entries of its slot's state.
        back = STATE_LEN - (start - src)
        sv = tl.load(pool_ptr + (slot * p_s0 + back * p_s2)[:, None] + cols[None, :] * p_s1,
                     mask=(initial & ~from_x)[:, None] & cmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols * w_s0 + k * w_s1, mask=cmask, other=0.0).to(tl.float32)
        acc += _in_weight_dtype(xv + sv, w_ptr) * w[None, :]  # one of the two is zero
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = tl.where(live[:, None], _activate(acc, w_ptr.dtype.element_ty, SILU), 0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * o_s0 + cols[None, :], out,
             mask=(rows < tokens)[:, None] & cmask[None, :])


@triton.jit
def _conv_states_kernel(
    x_ptr, pool_ptr, cu_ptr, slots_ptr, init_ptr, channels, x_s0, x_s1, p_s0, p_s1, p_s2,
    STATE_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_S)[:, None]
    # The sequence's scalars as tiles (masks mix them with the columns).
    zero = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.int32)
    slot = zero + tl.load(slots_ptr + seq)
    keep = (cols[None, :] < channels) & (j < STATE_LEN) & (slot >= 0)
    initial = keep & ((zero + tl.load(init_ptr + seq).to(tl.int32)) != 0)
    start = tl.load(cu_ptr + seq)
    # Entry j of the new state is entry length + j of (old state, the sequence's rows).
    pos = zero + tl.load(cu_ptr + seq + 1) - start + j
    state = pool_ptr + slot.to(tl.int64) * p_s0 + cols[None, :] * p_s1
    old = tl.load(state + pos * p_s2, mask=initial & (pos < STATE_LEN), other=0.0)
    new = tl.load(x_ptr + (start + pos - STATE_LEN).to(tl.int64) * x_s0 + cols[None, :] * x_s1,
                  mask=keep & (pos >= STATE_LEN), other=0.0)
    tl.debug_barrier()  # every thread's reads of the old state before any write
    tl.store(state + j * p_s2, tl.where(pos < STATE_LEN, old, new), mask=keep)


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, pool_ptr, slots_ptr, initial_ptr,
    channels, x_s0, x_s1, w_s0, w_s1, o_s0, p_s0, p_s1, p_s2,
    STATE_LEN: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_INITIAL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    j = tl.arange(0, BLOCK_S)[:, None]
    # The slot as a vector (masks mix it with the columns).
    slot = tl.zeros([BLOCK_C], dtype=tl.int32) + tl.load(slots_ptr + seq)
    live = cmask & (slot >= 0)
    state = pool_ptr + slot.to(tl.int64) * p_s0 + cols * p_s1
    keep = live[None, :] & (j < STATE_LEN)
    reads = keep
    if HAS_INITIAL:  # a sequence's first token reads zeros, not the slot
        reads = keep & ((tl.zeros([BLOCK_C], dtype=tl.int32)
                         + tl.load(initial_ptr + seq).to(tl.int32)) != 0)[None, :]
    old = tl.load(state[None, :] + j * p_s2, mask=reads, other=0.0)
    x = tl.load(x_ptr + seq.to(tl.int64) * x_s0 + cols * x_s1, mask=cmask, other=0.0)
    # The window is (state, x): state entry j meets tap j - (STATE_LEN + 1 - WIDTH).
    tap = j - (STATE_LEN + 1 - WIDTH)
    w = tl.load(w_ptr + cols[None, :] * w_s0 + tap * w_s1,
                mask=cmask[None, :] & (tap >= 0) & (j < STATE_LEN), other=0.0)
    acc = tl.sum(_in_weight_dtype(old, w_ptr) * w.to(tl.float32), axis=0)
    w = tl.load(w_ptr + cols * w_s0 + (WIDTH - 1) * w_s1, mask=cmask, other=0.0)
    acc += _in_weight_dtype(x, w_ptr) * w.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + seq.to(tl.int64) * o_s0 + cols,
             _activate(acc, w_ptr.dtype.element_ty, SILU), mask=cmask)
    tl.debug_barrier()  # every thread's reads of the old state before any write
    # The state rolls one entry left, x last.
    tl.store(state[None, :] + (j - 1) * p_s2, old, mask=keep & (j >= 1))
    tl.store(state + (STATE_LEN - 1) * p_s2, x, mask=live)


def causal_conv_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        cu_seqlens: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
                        has_initial: torch.Tensor, activation: str | None = "silu"
                        ) -> torch.Tensor:
    """Triton twin of ``reference.causal_conv_prefill``; ``x`` may be a strided view."""
    check_conv("causal_conv_prefill", x, weight, bias, conv_pool, slots, activation,
               cu_seqlens, has_initial)
    (tokens, channels), width = x.shape, weight.shape[1]
    batch, state_len = slots.shape[0], conv_pool.shape[2]
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    pools = (conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2))
    blocks = triton.cdiv(channels, _BLOCK_C)
    if tokens:
        launch(_conv_rows_kernel, (triton.cdiv(tokens, _BLOCK_T), blocks),
               x, weight, bias if bias is not None else weight, out, conv_pool, cu_seqlens, slots,
               has_initial, tokens, channels, batch, x.stride(0), x.stride(1),
               weight.stride(0), weight.stride(1), out.stride(0), *pools,
               STATE_LEN=state_len, WIDTH=width, SEARCH_STEPS=batch.bit_length(),
               HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=_BLOCK_T,
               BLOCK_C=_BLOCK_C, num_warps=4, **pdl_options(x))
    if batch:
        launch(_conv_states_kernel, (batch, blocks),
               x, conv_pool, cu_seqlens, slots, has_initial, channels, x.stride(0), x.stride(1),
               *pools, STATE_LEN=state_len, BLOCK_S=triton.next_power_of_2(state_len),
               BLOCK_C=_BLOCK_C, num_warps=4, **pdl_options(x))
    return out


def causal_conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_pool: torch.Tensor, slots: torch.Tensor,
                       activation: str | None = "silu",
                       has_initial: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``reference.causal_conv_decode``: one launch, the states rolled in
    place."""
    check_conv("causal_conv_decode", x, weight, bias, conv_pool, slots, activation,
               has_initial=has_initial)
    if has_initial is not None and has_initial.dtype == torch.bool:
        has_initial = has_initial.view(torch.uint8)  # a view: no launch, no copy
    batch, channels = x.shape
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    launch(_conv_decode_kernel, (batch, triton.cdiv(channels, _BLOCK_C)),
           x, weight, bias if bias is not None else weight, out, conv_pool, slots,
           slots if has_initial is None else has_initial,
           channels, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
           out.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2),
           STATE_LEN=conv_pool.shape[2], WIDTH=weight.shape[1], HAS_BIAS=bias is not None,
           SILU=activation is not None, HAS_INITIAL=has_initial is not None,
           BLOCK_S=triton.next_power_of_2(conv_pool.shape[2]),
           BLOCK_C=_BLOCK_C, num_warps=4, **pdl_options(x))
    return out
