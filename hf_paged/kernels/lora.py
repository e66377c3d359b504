"""LoRA adapters, unmerged, many in one batch: each row's adapter delta added to a projection's
output, in two launches ("shrink" then "expand", as punica's SGMV kernels), over row tiles
that group the rows of each adapter (``kernels.lora_tiles``):

1. shrink: ``h = x @ a[slot].T`` per tile, ``[splits, G*BLOCK_M, P*R]`` in float32 scratch,
   a program owning a tile, a tile of ``h``'s columns and a share of K;
2. expand: ``out += scaling * h_part @ b[slot].T`` per tile, a program owning a tile and a
   tile of output columns, taking each column's part's slice of ``h``.

The kernels gather ``x``'s rows and scatter ``out``'s by the tile's row indices; ``h`` is
addressed by tile, so a tile's scratch is contiguous. The grid depends only on the tiles'
count (a decode graph's bound): padding tiles and tiles on no adapter return at once, and a
graph replays for any rows and slots. Two variants save the launches around the projection:

- normed (``norm``): ``x`` is the pre-norm hidden state (the residual stream the fused
  ``normed_linear`` returns) and the kernels normalise it themselves, in one pass over ``x``:
  the shrink multiplies ``(x * weight)`` (rounded to ``x``'s dtype, the tensor cores' input)
  by ``a`` and sums the squares of ``x`` over its share of K into a scratch of its own, and the
  expand scales each row's ``h`` by ``rsqrt(mean + eps)`` from the shares' sums. ``rms_norm``
  rounds ``x * inv_rms`` before the weight's product: the normed input differs from it by a
  rounding or two of the model's dtype an element (a relative ``2^-8`` at most in bf16),
  averaging out in ``h``'s sums, below the delta's own rounding (a second pass over ``x``
  to round as ``rms_norm`` does would double the shrink's reads of ``x``);
- gated (``gated``, a merged gate/up projection of two equal parts): the expand adds the
  deltas to the gate and up columns of an intermediate index and writes the SwiGLU product
  (``silu_and_mul``'s casts) to a new ``[T, I]`` tensor, every row's (the tiles on no adapter
  add nothing). ``out`` is left as it is.

At decode both kernels are bound by reading the adapters, the shrink's ``P*R x K`` of ``a``
above all, and a batch of few tiles would give it few programs: the shrink then splits K,
each share writing its partial sums to its own slice of the scratch, and the expand sums the
slices as it loads ``h`` (the same result on every run: no atomics). Both use ``tl.dot``, a
decode tile padded to 16 rows: wasted tensor-core rows cost nothing in kernels bound by their
loads, and prefill's tiles need the tensor cores' rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.lora_tiles import LoraTiles
from hf_paged.kernels.reference_lora import check_lora

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
def _tile(order_ptr, tiles_ptr, t_s0, BLOCK_M: tl.constexpr):
    """This program's tile (program axis 0): its slot, its rows' indices (int64: offsets of
    whole rows), which lanes hold a row, and whether it is empty (a padding tile)."""
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + t_s0 + tile)
    count = tl.load(tiles_ptr + 2 * t_s0 + tile)
    lanes = tl.arange(0, BLOCK_M)
    row_ok = lanes < count
    rows = tl.load(order_ptr + first + lanes, mask=row_ok, other=0).to(tl.int64)
    return slot.to(tl.int64), rows, row_ok, count <= 0


# Arguments that vary with the batch (the tile count and its stride, the split's share; the
# tiles' addresses, views of a packed buffer at any offset) are not specialised on: a new
# batch size compiles nothing new.
@triton.jit(do_not_specialize=["num_tiles", "t_s0", "share_steps"],
            do_not_specialize_on_alignment=["order_ptr", "tiles_ptr"])
def _shrink_kernel(
    x_ptr, norm_ptr, a_ptr, h_ptr, sq_ptr, order_ptr, tiles_ptr, num_tiles, t_s0, K,
    share_steps, x_s0, a_ss, a_sr, h_s0,
    COL_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORMED: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # every program waits, even one with nothing to do
    slot, rows, row_ok, empty = _tile(order_ptr, tiles_ptr, t_s0, BLOCK_M)
    if empty | (slot < 0):
        return
    split = tl.program_id(1) // COL_TILES
    cols = tl.program_id(1) % COL_TILES * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    # A share in whole steps, so that the compiler knows its start's alignment (the loads'
    # width) without specialising on it.
    k_share = share_steps * BLOCK_K
    k_lo = split * k_share
    x_ptrs = x_ptr + rows[:, None] * x_s0 + k_lo + ks[None, :]
    a_ptrs = a_ptr + slot * a_ss + k_lo + (cols[None, :] * a_sr + ks[:, None])  # [K, R] view
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, tl.minimum(k_share, K - k_lo), BLOCK_K):
        k_ok = ks < K - k_lo - k
        if EVEN_K:  # whole steps: no mask along the contiguous K keeps the loads wide
            x = tl.load(x_ptrs + k, mask=row_ok[:, None], other=0.0)
            a = tl.load(a_ptrs + k)
        else:
            x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs + k, mask=k_ok[:, None], other=0.0)
        if NORMED:  # x * weight, and x's squares for the inverse RMS the expand applies
            w = tl.load(norm_ptr + k_lo + k + ks, mask=k_ok, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * w[None, :]).to(x.dtype)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    # the scratch [splits, G*BLOCK_M, P*R], by tile: its strides multiples of its row's
    lanes = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h_ptrs = h_ptr + split * num_tiles * BLOCK_M * h_s0 + (lanes[:, None] * h_s0 + cols[None, :])
    tl.store(h_ptrs, acc)
    if NORMED:
        if tl.program_id(1) % COL_TILES == 0:  # once a share: every column tile's are equal
            tl.store(sq_ptr + split * num_tiles * BLOCK_M + lanes, squares)


@triton.jit
def _part_delta(acc, h_ptrs, b_ptrs, scale, rows_ok, cols_ok, splits, split_s,
                BLOCK_M: tl.constexpr, R: tl.constexpr, PRECISION: tl.constexpr):
    """``acc`` plus one part's ``scale * h_part @ b_part.T`` over a tile of columns (``scale``
    a row's, ``[BLOCK_M, 1]``), the shrink's partial sums added up as ``h`` loads; masked
    rows and columns add zero."""
    h = tl.zeros([BLOCK_M, R], tl.float32)
    for split in range(splits):
        h += tl.load(h_ptrs + split * split_s, mask=rows_ok[:, None], other=0.0)
    # b in float32, as the product is defined; for 16-bit outputs on the TF32 tensor cores,
    # which hold b exactly and round h to 11 significant bits, well below the delta's
    # rounding to the output's dtype.
    b = tl.load(b_ptrs, mask=cols_ok[None, :], other=0.0).to(tl.float32)
    return tl.dot(h * scale, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_tiles", "t_s0", "splits"],
            do_not_specialize_on_alignment=["order_ptr", "tiles_ptr"])
def _expand_kernel(
    h_ptr, sq_ptr, b_ptr, scaling_ptr, part_ptr, out_ptr, act_ptr, order_ptr, tiles_ptr,
    num_tiles, t_s0, N, K, eps, splits, h_s0, b_ss, b_sn, sc_s0, out_s0, act_s0,
    P: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NORMED: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    slot, rows, row_ok, empty = _tile(order_ptr, tiles_ptr, t_s0, BLOCK_M)
    on_adapter = slot >= 0
    idle = empty | (slot < 0)
    if GATED:  # a tile on no adapter still writes its rows' product
        idle = empty
    if idle:
        return
    slot = tl.maximum(slot, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    lanes = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, R)
    h_ptrs = h_ptr + lanes[:, None] * h_s0 + rs[None, :]
    split_s = num_tiles * BLOCK_M * h_s0
    b_ptrs = b_ptr + slot * b_ss + (cols[None, :] * b_sn + rs[:, None])  # [R, N] view
    # A tile on no adapter has no h: nothing is read. (``tl.where``: the interpreter makes
    # int32 of ``&`` between a bool vector and a bool scalar.)
    h_ok = tl.where(on_adapter, row_ok, False)
    b_ok = tl.where(on_adapter, col_ok, False)
    row_scale = tl.full([BLOCK_M, 1], 1.0, tl.float32)
    if NORMED:  # the inverse RMS of x's rows, from the shrink's shares' sums of squares
        squares = tl.zeros([BLOCK_M], tl.float32)
        for split in range(splits):
            squares += tl.load(sq_ptr + split * num_tiles * BLOCK_M + lanes, mask=h_ok,
                               other=0.0)
        row_scale = tl.rsqrt(squares / K + eps)[:, None]
    dtype = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + rows[:, None] * out_s0 + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:  # N: the intermediate size; gate's columns, then up's N further
        scales = scaling_ptr + slot * sc_s0
        acc = _part_delta(acc, h_ptrs, b_ptrs, tl.load(scales) * row_scale, h_ok, b_ok,
                          splits, split_s, BLOCK_M, R, PRECISION)
        up = _part_delta(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), h_ptrs + R,
                         b_ptrs + N * b_sn, tl.load(scales + 1) * row_scale, h_ok, b_ok,
                         splits, split_s, BLOCK_M, R, PRECISION)
        # The deltas rounded to the output's dtype, added in it; then silu_and_mul's casts.
        gate = (tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
                + acc.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        up = (tl.load(o_ptrs + N, mask=mask, other=0.0).to(tl.float32)
              + up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(act_ptr + rows[:, None] * act_s0 + cols[None, :], (silu * up).to(dtype),
                 mask=mask)
    else:
        part = tl.load(part_ptr + cols, mask=col_ok, other=-1)
        # The parts this tile's columns belong to (one, unless the tile straddles a boundary
        # of a merged projection): a product per part, b's rows of other parts masked out.
        for p in range(tl.min(tl.where(col_ok, part, P), axis=0), tl.max(part, axis=0) + 1):
            scale = tl.load(scaling_ptr + slot * sc_s0 + p) * row_scale
            acc = _part_delta(acc, h_ptrs + p * R, b_ptrs, scale, h_ok, part == p, splits,
                              split_s, BLOCK_M, R, PRECISION)
        # The delta rounded to the output's dtype, then added in it: the reference's casts.
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
             scaling: torch.Tensor, row_part: torch.Tensor, tiles: LoraTiles,
             norm: tuple[torch.Tensor, float] | None = None, gated: bool = False, *,
             num_splits: int | None = None) -> torch.Tensor:
    """Triton twin of ``reference.add_lora``: ``out [T, N]`` plus each row's adapter delta,
    in place (returned); ``gated``: the SwiGLU product of that sum, a new ``[T, N/2]``
    (``out`` unchanged). ``num_splits`` overrides the shrink's split of K."""
    check_lora(out, x, a, b, scaling, row_part, tiles, norm, gated)
    assert x.stride(1) == out.stride(1) == a.stride(2) == b.stride(2) == scaling.stride(1) == 1
    order, tile_data, block_m = tiles
    tokens, k = x.shape
    n, rank = b.shape[1:]
    num_parts, num_tiles = scaling.shape[1], tile_data.shape[1]
    result = out.new_empty(tokens, n // 2) if gated else out
    if tokens == 0 or num_tiles == 0:
        return result
    # float32 products in full precision (not TF32), as torch's matmul by default
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_r = min(rank, _MAX_BLOCK_R)
    col_tiles = num_parts * rank // block_r
    block_k = 64 if x.dtype == torch.float32 else 128  # 16 KB of x a step at prefill
    splits, share = (_split_k(num_tiles * col_tiles, k, block_k) if num_splits is None
                     else _shares(k, num_splits, block_k))
    h = torch.empty((splits, num_tiles * block_m, num_parts * rank), dtype=torch.float32,
                    device=x.device)
    # the normed variant's sums of squares, a row of a tile a share; else never read
    squares = torch.empty((splits, num_tiles * block_m) if norm else (1,), dtype=torch.float32,
                          device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)  # (x: never read)
    pdl = pdl_options(x)
    launch(_shrink_kernel, (num_tiles, col_tiles * splits),
           x, norm_weight, a, h, squares, order, tile_data, num_tiles, tile_data.stride(0), k,
           share // block_k, x.stride(0), a.stride(0), a.stride(1), h.stride(1),
           COL_TILES=col_tiles, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
           EVEN_K=k % block_k == 0, NORMED=norm is not None, PRECISION=precision,
           num_warps=4, num_stages=3, **pdl)
    # (three stages: at decode, bound by reading ``a``, more of it in flight; at prefill
    # 96 KB of shared memory, two programs an SM)
    columns = n // 2 if gated else n
    launch(_expand_kernel, (num_tiles, triton.cdiv(columns, _BLOCK_N)),
           h, squares, b, scaling, row_part, out, result, order, tile_data, num_tiles,
           tile_data.stride(0), columns, k, eps, splits, h.stride(1), b.stride(0), b.stride(1),
           scaling.stride(0), out.stride(0), result.stride(0),
           P=num_parts, R=rank, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, NORMED=norm is not None,
           GATED=gated, PRECISION=precision, num_warps=8 if block_m * rank >= 64 * 64 else 4,
           num_stages=2, **pdl)
    # (eight warps for prefill tiles of rank 64 and more: with four, h and b's float32 tiles
    # took up to 254 registers a thread at rank 128 for sm_90, and 166 at 64; with eight,
    # 165 and 102)
    return result
