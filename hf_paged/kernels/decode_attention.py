"""The decode side of ``kernels.attention``: when a batch's (sequence, KV head) pairs are too
few to fill the GPU, the split-K policy (flash-decoding) and the merge of the splits' partial
results, and the cascade's kernel over a prefix every sequence shares."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_paged.kernels.attention_tiles import attend_tiles
from hf_paged.kernels.gdc import wait_for_previous

MAX_SPLITS = 32


@triton.jit(do_not_specialize=["num_tokens", "num_parts", "table_stride"],
            do_not_specialize_on_alignment=["table_ptr", "shared_ptr"])
def shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, table_ptr, table_stride,
    shared_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, num_tokens, num_heads, num_parts,
    q_s0, q_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Parts ``0..P-1`` (one per program along axis 2) of every query token's attention over
    the shared prefix: the first ``shared`` keys, rounded down to whole key tiles, held in the
    blocks of ``table_ptr`` and visible to every query. ``FP8``: as ``kernels.attention``."""
    wait_for_previous(PDL)
    kv_head = tl.program_id(1)
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < num_tokens)
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = tok.to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_s0 + head[:, None] * q_s1 + dims[None, :], mask=mask,
                other=0.0)
    if FP8 and q.dtype != tl.float32:  # 16-bit queries: float16 tiles, as ``kernels.attention``
        q = q.to(tl.float16)
    n_tiles = tl.load(shared_ptr) // BLOCK_N
    per_split = tl.cdiv(n_tiles, tl.num_programs(2))
    tile_lo = per_split * split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m, denom = attend_tiles(
        acc, m, denom, q, k_cache_ptr + kv_head * k_s2, v_cache_ptr + kv_head * v_s2, table_ptr,
        table_stride, tok, n_tiles * BLOCK_N, tile_lo, tile_hi, k_s0, k_s1, v_s0, v_s1, scale_log2,
        BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, False, PRECISION)
    denom = tl.where(denom == 0.0, 1.0, denom)
    part = (q_rows * num_heads + head) * num_parts + split
    out = acc / denom[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=mask)
    tl.store(part_lse_ptr + part, m + tl.log2(denom), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, o_s0, o_s1,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(
        part_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (row // num_heads) * o_s0 + (row % num_heads) * o_s1 + dims, out,
             mask=dims < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # CPU tensors (Triton's interpreter): act as a 132-SM GPU would


def decode_splits(programs: int, max_tiles: int, device: torch.device, fp8: bool = False) -> int:
    """Split-K factor for ``programs`` (sequence, KV head) pairs: none from four programs per
    SM on, else enough for about six per SM (at least two), never more than the key tiles the
    block table can address (its width, not its contents, so the choice is fixed per graph
    batch). ``fp8``: the FP8 cache's 2-warp tile, which wants about four programs per SM and
    none split below that.

    Measured on an H100 (132 SMs), programs started longest context first, contexts of
    800-2,048 tokens, as fractions of copy bandwidth: 320-512 programs (2.4-3.9 per SM) reached
    90-93% split two ways against 84-89% unsplit, where one or two waves of programs leave
    SMs idle behind the longest; 576 reached 95.7% unsplit against 94.7% split two ways; 128
    programs 78% split six ways (this rule's choice), against 47% unsplit. Over an FP8 cache
    (0.6B shape, 8 KV heads, contexts of 600-1,600 tokens, every factor from 1 to 16 timed), the
    fastest were 4 at 8 and 16 sequences (16.8 / 25.6 us against 19.6 / 28.8 by the bf16 rule), 2
    at 32 (43.3 against 47.3), 1 at 64 (71.0 against 76.6) and within 4% of 1 from 96 on."""
    sms = _sm_count(device)
    if fp8:
        return max(1, min(MAX_SPLITS, max_tiles, round(4 * sms / programs)))
    if programs >= 4 * sms:
        return 1
    return max(1, min(MAX_SPLITS, max_tiles, max(2, round(6 * sms / programs))))
