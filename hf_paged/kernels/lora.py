"""LoRA adapters, unmerged, many in one batch: each sequence's low-rank delta added to a
projection's output, in two launches ("shrink" then "expand", as punica's SGMV kernels):

1. shrink: ``h = x @ a[slot].T`` per sequence, ``[T, P*R]`` in float32 scratch; a program
   owns a tile of one sequence's rows, a tile of ``h``'s columns and a share of K;
2. expand: ``out += scaling * h_part @ b[slot].T`` per sequence, a program owning a tile of
   its rows and a tile of output columns, taking each column's part's slice of ``h``.

A program reads its sequence's slot and row range from the device (graph input buffers), and
the grid depends only on the shapes and ``max_rows``: no host sync, so a CUDA graph replays it
for any slots and lengths. Programs of a sequence without an adapter (slot -1), or of row
tiles past its end, return at once: a decode batch reads only the adapters it uses.

At decode (a row a sequence) both kernels are bound by reading the adapters, the shrink's
``P*R x K`` of ``a`` above all, and a batch of few sequences would give it few programs. So
the shrink splits K over several programs when the grid is small, each writing its partial
sums to its own slice of the scratch, and the expand sums the slices as it loads ``h``: the
same result on every run (no atomics), and no third launch. Both kernels use ``tl.dot``, rows
padded to 16 at decode: the tensor cores' wasted rows cost nothing in kernels bound by their
loads, and prefill's row tiles need the tensor cores' rate. A tile never spans sequences, so
sequences that share an adapter each read it (from L2 after the first): grouping rows by
adapter would take a sort on the device first, as the MoE kernels group tokens by expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_lora import check_lora

# Row tiles: 16 (tl.dot's least) when every run fits one, as at decode; else 64, a prefill
# GEMM's usual height (larger tiles would mostly pad the short runs of a mixed batch).
_DECODE_ROWS, _PREFILL_ROWS = 16, 64
# Shrink columns: a whole rank up to 64 (ranks are powers of two from 16, so tiles never
# straddle a part and need no mask); R=128 takes two tiles, keeping the accumulator small.
_MAX_BLOCK_R = 64
# Expand columns: 64 output columns by the whole rank (up to 128): b's tile, converted to
# float32 for the product (below), and h's take up to 64 KB of registers at prefill.
_BLOCK_N = 64
# Split-K: below this many shrink programs (two per SM of an H100) the shrink splits K, into
# shares of at least this many columns (fewer partial sums for the expand to read back).
_TARGET_PROGRAMS = 264
_MIN_SPLIT_COLS = 512


@triton.jit
def _sequence(cu_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """This program's sequence's slot, the index of its row tile's first row (program axes 0
    and 1), which rows of the tile the sequence owns, and whether it is idle: no adapter, or
    no rows. Tensors are addressed from the first row on, in int32 offsets within the tile:
    64-bit offsets for every element of a tile would take twice the registers."""
    seq = tl.program_id(0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(cu_ptr + seq)
    first = tl.program_id(1) * BLOCK_M
    left = tl.load(cu_ptr + seq + 1) - start - first
    idle = (slot < 0) | (left <= 0)
    return slot, (start + first).to(tl.int64), tl.arange(0, BLOCK_M) < left, idle


# Arguments that vary with the batch (the token count; the split count and share, which follow
# the grid) are not specialised on: a new batch size compiles nothing new.
@triton.jit(do_not_specialize=["tokens", "share_steps"])
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, cu_ptr, slots_ptr, tokens, K, share_steps, x_s0, a_ss, a_sr, h_s0,
    COL_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # every program waits, even one with nothing to do
    slot, first, row_ok, idle = _sequence(cu_ptr, slots_ptr, BLOCK_M)
    if idle:
        return
    split = tl.program_id(2) // COL_TILES
    cols = tl.program_id(2) % COL_TILES * BLOCK_R + tl.arange(0, BLOCK_R)
    lanes = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    # A share in whole steps, so that the compiler knows its start's alignment (the loads'
    # width) without specialising on it.
    k_share = share_steps * BLOCK_K
    k_lo = split * k_share
    x_ptrs = x_ptr + first * x_s0 + k_lo + (lanes[:, None] * x_s0 + ks[None, :])
    a_ptrs = a_ptr + slot * a_ss + k_lo + (cols[None, :] * a_sr + ks[:, None])  # [K, R] view
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k in range(0, tl.minimum(k_share, K - k_lo), BLOCK_K):
        if EVEN_K:  # whole steps: no mask along the contiguous K keeps the loads wide
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            a = tl.load(a_ptrs + k)
        else:
            k_ok = ks < K - k_lo - k
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs + k, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    # the scratch [splits, T, P*R]: its strides multiples of its row's (known to divide by 16)
    h_ptrs = h_ptr + (split * tokens + first) * h_s0 + (lanes[:, None] * h_s0 + cols[None, :])
    tl.store(h_ptrs, acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["tokens", "splits"])
def _expand_kernel(
    h_ptr, b_ptr, scaling_ptr, part_ptr, out_ptr, cu_ptr, slots_ptr, tokens, N, splits, h_s0,
    b_ss, b_sn, sc_s0, out_s0,
    P: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    slot, first, row_ok, idle = _sequence(cu_ptr, slots_ptr, BLOCK_M)
    if idle:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    part = tl.load(part_ptr + cols, mask=col_ok, other=-1)
    lanes = tl.arange(0, BLOCK_M)
    rs = tl.arange(0, R)
    h_ptrs = h_ptr + first * h_s0 + (lanes[:, None] * h_s0 + rs[None, :])
    b_ptrs = b_ptr + slot * b_ss + (cols[None, :] * b_sn + rs[:, None])  # [R, N] view
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # The parts this tile's columns belong to (one, unless the tile straddles a boundary of
    # a merged projection): a product per part, b's rows of other parts masked to zero.
    for p in range(tl.min(tl.where(col_ok, part, P), axis=0), tl.max(part, axis=0) + 1):
        h = tl.zeros([BLOCK_M, R], tl.float32)
        for split in range(splits):  # the shrink's partial sums over K
            h += tl.load(h_ptrs + split * tokens * h_s0 + p * R, mask=row_ok[:, None], other=0.0)
        h *= tl.load(scaling_ptr + slot * sc_s0 + p)
        # b in float32, as the product is defined; for 16-bit outputs on the TF32 tensor
        # cores, which hold b exactly and round h to 11 significant bits, well below the
        # delta's rounding to the output's dtype.
        b = tl.load(b_ptrs, mask=(part == p)[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(h, b, acc, input_precision=PRECISION)
    # The delta rounded to the output's dtype, then added in it: the reference's casts.
    dtype = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + first * out_s0 + (lanes[:, None] * out_s0 + cols[None, :])
    mask = row_ok[:, None] & col_ok[None, :]
    base = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (base + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def _split_k(programs: int, k: int, block_k: int) -> tuple[int, int]:
    """The shrink's split of K (count, columns a share, a multiple of ``block_k``) for a grid
    of ``programs`` without it: none for a grid that fills the GPU, else enough shares to
    fill it, each at least ``_MIN_SPLIT_COLS`` wide."""
    want = min(triton.cdiv(_TARGET_PROGRAMS, programs), triton.cdiv(k, _MIN_SPLIT_COLS))
    return _shares(k, max(want, 1), block_k)


def _shares(k: int, splits: int, block_k: int) -> tuple[int, int]:
    share = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return triton.cdiv(k, share), share


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, row_part: torch.Tensor, cu_seqlens: torch.Tensor,
             slots: torch.Tensor, max_rows: int, *, num_splits: int | None = None
             ) -> torch.Tensor:
    """Triton twin of ``reference.add_lora``: ``out [T, N]`` plus each sequence's adapter
    delta, in place (returned). ``max_rows`` bounds the grid: no sequence may be longer (the
    scheduler knows it; 1 at decode). ``num_splits`` overrides the shrink's split of K."""
    check_lora(out, x, a, b, scaling, row_part, cu_seqlens, slots)
    assert x.stride(1) == out.stride(1) == a.stride(2) == b.stride(2) == scaling.stride(1) == 1
    tokens, k = x.shape
    n, rank = b.shape[1:]
    num_parts = scaling.shape[1]
    num_seqs = slots.shape[0]
    if tokens == 0 or num_seqs == 0 or max_rows <= 0:
        return out
    block_m = _DECODE_ROWS if max_rows <= _DECODE_ROWS else _PREFILL_ROWS
    row_tiles = triton.cdiv(max_rows, block_m)
    # float32 products in full precision (not TF32), as torch's matmul by default
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_r = min(rank, _MAX_BLOCK_R)
    col_tiles = num_parts * rank // block_r
    block_k = 64 if x.dtype == torch.float32 else 128  # 16 KB of x a step at prefill
    programs = num_seqs * row_tiles * col_tiles
    splits, share = (_split_k(programs, k, block_k) if num_splits is None
                     else _shares(k, num_splits, block_k))
    h = torch.empty((splits, tokens, num_parts * rank), dtype=torch.float32, device=x.device)
    pdl = pdl_options(x)
    launch(_shrink_kernel, (num_seqs, row_tiles, col_tiles * splits),
           x, a, h, cu_seqlens, slots, tokens, k, share // block_k, x.stride(0), a.stride(0),
           a.stride(1), h.stride(1),
           COL_TILES=col_tiles, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
           EVEN_K=k % block_k == 0, PRECISION=precision, num_warps=4, num_stages=3, **pdl)
    # (three stages: at decode, bound by reading ``a``, more of it in flight; at prefill
    # 96 KB of shared memory, two programs an SM; compiled for sm_90 without spills)
    launch(_expand_kernel, (num_seqs, row_tiles, triton.cdiv(n, _BLOCK_N)),
           h, b, scaling, row_part, out, cu_seqlens, slots, tokens, n, splits, h.stride(1),
           b.stride(0), b.stride(1), scaling.stride(0), out.stride(0),
           P=num_parts, R=rank, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, PRECISION=precision,
           num_warps=8 if block_m * rank >= 64 * 64 else 4, num_stages=2, **pdl)
    # (eight warps for prefill tiles of rank 64 and more: with four, h and b's float32 tiles
    # took up to 254 registers a thread at rank 128 for sm_90, and 166 at 64; with eight,
    # 165 and 102)
    return out
