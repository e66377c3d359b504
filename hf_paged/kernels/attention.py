"""Causal attention of variable-length queries over the paged KV cache.

One kernel serves prefill, chunked prefill and decode. A program owns a tile of query rows:
``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query heads that share
a KV head (row ``r`` is token ``r // GROUP``, head ``r % GROUP`` of the group), so every key and
value tile it gathers through the block table is read once for the whole group. Scores go
through ``tl.dot``, rows padded to at least 16: a decode tile is 1 token x GROUP heads, and the
tensor cores' wasted rows cost nothing in a kernel bound by reading the cache, while a
broadcast-multiply would hold a ``[GROUP, BLOCK_N, D]`` product in registers.

Decode (``max_query_len == 1``) runs one program per (sequence, KV head). When those are too few
to fill the GPU, the keys are split across ``num_splits`` programs (flash-decoding) that write
partial results and their log-sum-exp, merged by a second kernel. The split count depends only
on the shapes, so decode is safe to capture in a CUDA graph: no host sync, no value-dependent
allocation. Programs start in launch order, a sequence's heads and splits together; given
``order`` (the sequences longest context first), the last to start are the shortest, so the
GPU does not idle at the end on a long sequence that started late.

Cascade decode: when every sequence's context starts with the same cache blocks (a prompt shared
through the prefix cache), reading those keys once per sequence is the cost of a large batch.
Given the shared length (a device scalar, so one captured graph serves any), one more kernel
attends tiles of ``BLOCK_Q`` query tokens to the shared prefix, reading each key once per tile;
the decode kernel covers only each sequence's own keys after it, and the partial results merge
as the splits do.

An FP8 cache (float8_e4m3fn, one code path by the constexpr ``FP8``): with 16-bit queries the
tiles' products run in float16, so keys and values are converted as loaded with one packed
convert per two elements (exact; to bf16 a Hopper GPU takes three converts per two, which
bound the kernel below the bandwidth a byte an element allows), the query too (exact within
float16's range, which ``worker.kv_cache.check_float16_queries`` makes sure of at start-up)
and the softmax's probabilities (more precise than in bf16); float32 queries keep float32.
The KV head's key scale is folded into the softmax scale and its value scale into the output,
so a decode step reads one byte an element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels import ORDERED_MIN_SEQS
from hf_paged.kernels.attention_tiles import attend_tiles
from hf_paged.kernels.decode_attention import (
    MAX_SPLITS,
    combine_splits_kernel,
    decode_splits,
    shared_prefix_kernel,
)
from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch

_LOG2E = 1.4426950408889634
# (query rows, keys per iteration, warps, pipeline stages); a decode program holds one token's
# GQA group.
DECODE_TILE = (16, 64, 4, 2)
_PREFILL_TILE = (64, 64, 4, 3)
_SHARED_TILE = (64, 64, 4, 3)  # cascade decode's shared prefix: BLOCK_M // GROUP tokens a tile
# An FP8 cache's decode tile: half the warps of the bf16 tile and one more stage, the same
# keys a tile. On an H100 at the 0.6B shape (blocks of 64), decode over an FP8 cache took, at
# 256 / 64 / 16 sequences of 600-1,600 tokens and 256 of 100-400: 241 / 77 / 29 / 73 us, against
# 242 / 81 / 30 / 82 with 128-key tiles of 4 warps capped at 168 registers (the bf16 cache:
# 397 / 127 / 37 / 99). Capping this tile's registers at 128 halved its speed; 32-key tiles
# gained at short contexts only. The shared prefix's tiles are the bf16 ones (the two kernels
# round the shared length to the same tiles).
_FP8_DECODE_TILE = (16, 64, 2, 3)
# Per-sequence index arguments, read a few int32 at a time: their alignment is left out of the
# compiled variant, so views into a graph's packed input buffer (at any offset) share the
# variants of separately allocated tensors instead of compiling their own.
_INDEX_ARGS = ["cu_q_ptr", "seq_lens_ptr", "block_tables_ptr", "shared_ptr", "order_ptr"]


@triton.jit
def _find_sequence(cu_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile ``tile``, when sequence ``b``'s tiles start at
    ``cu_q[b] // BLOCK_Q + b`` (room for its ``cdiv(q_len, BLOCK_Q)`` tiles, known on device)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owns = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    return lo


# Arguments that vary with the batch (its size, its block-table width, the split count) are
# not specialised on (Triton would compile a variant for 1, for multiples of 16 and for the
# rest): a prompt of a length not seen before then needs no compilation.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "num_parts", "bt_s0", "bt_s1"],
            do_not_specialize_on_alignment=_INDEX_ARGS)
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    cu_q_ptr, seq_lens_ptr, block_tables_ptr, shared_ptr, order_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, num_seqs, num_heads, num_splits, num_parts,
    q_s0, q_s1, o_s0, o_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, bt_s0, bt_s1,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DECODE: tl.constexpr,
    SPLIT: tl.constexpr, CASCADE: tl.constexpr, ORDERED: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if FP8:  # the key scale in the softmax's (scales are set at start-up, never in a step)
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    if DECODE:  # at most one query token per sequence
        if ORDERED:  # grid (split, KV head, rank): ``order[rank]`` is the sequence
            split = tl.program_id(0)
            seq = tl.load(order_ptr + tl.program_id(2))
        else:  # grid (sequence, KV head, split)
            split = tl.program_id(2)
            seq = tl.program_id(0)
        q_tile = 0
    else:
        split = tl.program_id(2)
        # Last tiles first: causal tiles late in a sequence carry the most keys, and starting
        # them early keeps the GPU busy to the end.
        tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_sequence(cu_q_ptr, tile_id, num_seqs, BLOCK_Q)
        q_tile = tile_id - (tl.load(cu_q_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    first = q_tile * BLOCK_Q
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    # Query i sits at position ctx - q_len + i; the tile sees keys up to its last query.
    kv_end = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len)
    pos = tl.minimum(ctx - q_len + tok, kv_end - 1)  # clamped: padding rows stay finite
    q_rows = (q_start + tok).to(tl.int64)

    # This program's share of the key tiles (all of them without split-K), after a shared
    # prefix that the cascade kernel covers; those wholly at or before the tile's first query
    # need no mask.
    first_tile = tl.load(shared_ptr) // BLOCK_N if CASCADE else 0
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(n_tiles - first_tile, num_splits)
    tile_lo = first_tile + per_split * split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    unmasked_hi = tl.minimum(tl.maximum((ctx - q_len + first + 1) // BLOCK_N, tile_lo), tile_hi)
    k_ptr = k_cache_ptr + kv_head * k_s2
    v_ptr = v_cache_ptr + kv_head * v_s2
    table = block_tables_ptr + seq.to(tl.int64) * bt_s0
    wait_for_previous(PDL)  # every program waits, even one with nothing to do
    if first >= q_len:
        return
    q = tl.load(q_ptr + q_rows[:, None] * q_s0 + head[:, None] * q_s1 + dims[None, :], mask=mask,
                other=0.0)
    if FP8 and q.dtype != tl.float32:  # 16-bit queries: the tiles in float16 (module docstring)
        q = q.to(tl.float16)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m, denom = attend_tiles(
        acc, m, denom, q, k_ptr, v_ptr, table, bt_s1, pos, kv_end, tile_lo, unmasked_hi,
        k_s0, k_s1, v_s0, v_s1, scale_log2, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, False, PRECISION)
    acc, m, denom = attend_tiles(
        acc, m, denom, q, k_ptr, v_ptr, table, bt_s1, pos, kv_end, unmasked_hi, tile_hi,
        k_s0, k_s1, v_s0, v_s1, scale_log2, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, True, PRECISION)

    # A row that saw no key (an empty split, a padded sequence of length 0) comes out as zeros.
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = acc / denom[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    if SPLIT:  # partial result and its log-sum-exp (base 2; -inf when empty), after the
        # shared prefix's parts
        part = (q_rows * num_heads + head) * num_parts + num_parts - num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=mask)
        tl.store(part_lse_ptr + part, m + tl.log2(denom), mask=row_ok)
    else:
        tl.store(out_ptr + q_rows[:, None] * o_s0 + head[:, None] * o_s1 + dims[None, :], out,
                 mask=mask)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    shared_prefix: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.paged_attention``.

    ``max_query_len``: the longest query run of the batch, which the scheduler knows; 1 selects
    the decode kernel (CUDA-graph safe), so it must not understate. Without it the general
    kernel runs, right for any batch and free of host syncs as well. ``num_splits`` overrides
    the split-K policy (decode defaults to ``decode_splits``; prefill to no split).
    ``shared_prefix`` (decode only): a one-element int32 tensor, a length that every sequence's
    context exceeds and whose keys sit in the same blocks for all, those of
    ``block_tables[0]``; with it, decode runs as a cascade (module docstring). ``order``
    (decode only): int32, the sequences in the order their programs should start, longest
    context first (``modeling.attention.decode_order``), taken from ``ORDERED_MIN_SEQS``
    sequences on; without it, or below that, batch order. ``k_scale`` / ``v_scale``: an FP8
    cache's float32 scales per KV head.
    """
    num_tokens, num_heads, head_dim = query.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, num_seqs = num_heads // num_kv_heads, seq_lens.shape[0]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.dtype == v_cache.dtype and (fp8 or query.dtype == k_cache.dtype)
    assert not fp8 or (k_scale is not None and v_scale is not None)
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    decode = max_query_len == 1
    cascade = decode and shared_prefix is not None
    decode_tile = _FP8_DECODE_TILE if fp8 else DECODE_TILE
    block_m, block_n, num_warps, num_stages = decode_tile if decode else _PREFILL_TILE
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    # General path: sequence b's query tiles start at cu_q[b] // block_q + b (see
    # _find_sequence), so this many programs cover every tile without reading cu_q here.
    programs = num_seqs if decode else num_tokens // block_q + num_seqs
    max_tiles = triton.cdiv(block_tables.shape[1] * page, block_n)
    if num_splits is None:
        num_splits = 1
        if decode:
            num_splits = decode_splits(num_seqs * num_kv_heads, max_tiles, query.device, fp8)
    shared_splits = 0
    if cascade:
        shared_m, shared_n, shared_warps, shared_stages = _SHARED_TILE
        assert shared_n == block_n  # both kernels round the shared length to the same tiles
        shared_m = max(shared_m, triton.next_power_of_2(group))
        shared_tiles = triton.cdiv(num_tokens, shared_m // group)
        shared_splits = decode_splits(shared_tiles * num_kv_heads, max_tiles, query.device)
    num_parts = shared_splits + num_splits
    split = num_parts > 1
    if split:
        part_out = torch.empty((num_tokens, num_heads, num_parts, head_dim),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_heads, num_parts), dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out  # unused

    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    if cascade:
        launch(
            shared_prefix_kernel, (shared_tiles, num_kv_heads, shared_splits),
            query, k_cache, v_cache, part_out, part_lse, block_tables, block_tables.stride(1),
            shared_prefix, k_scale if fp8 else shared_prefix, v_scale if fp8 else shared_prefix,
            scale * _LOG2E, num_tokens, num_heads, num_parts,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group, BLOCK_Q=shared_m // group, BLOCK_M=shared_m, BLOCK_N=shared_n,
            BLOCK_D=block_d, HEAD_DIM=head_dim, PAGE=page, PRECISION=precision, FP8=fp8,
            num_warps=shared_warps, num_stages=shared_stages, **pdl_options(query),
        )
    ordered = decode and order is not None and num_seqs >= ORDERED_MIN_SEQS
    # Blocks start x first: in order, a sequence's splits and heads start together.
    grid = (num_splits, num_kv_heads, programs) if ordered else (programs, num_kv_heads, num_splits)
    launch(
        _attention_kernel, grid,
        query, k_cache, v_cache, out, part_out, part_lse, cu_seqlens_q, seq_lens, block_tables,
        shared_prefix if cascade else seq_lens, order if ordered else seq_lens,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        scale * _LOG2E, num_seqs, num_heads, num_splits, num_parts,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        block_tables.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HEAD_DIM=head_dim, PAGE=page, DECODE=decode, SPLIT=split, CASCADE=cascade,
        ORDERED=ordered, PRECISION=precision, FP8=fp8, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(query),
    )
    if split:
        launch(
            combine_splits_kernel, (num_tokens * num_heads,),
            part_out, part_lse, out, num_heads, num_parts, out.stride(0), out.stride(1),
            BLOCK_S=2 * MAX_SPLITS, BLOCK_D=block_d, HEAD_DIM=head_dim,  # one variant
            num_warps=4, **pdl_options(query),
        )
    return out
