"""Routing for the mixture-of-experts layers: each token's top-k experts and weights, and the
pairs of (token, slot) grouped by expert for the grouped GEMMs of ``moe_gemm``.

``moe_route`` is one program per token: the softmax over its expert logits in float32, the k
largest probabilities by repeated maximum (ties to the lowest expert, as ``torch.topk`` over
distinct values), renormalised, stored in the logits' dtype.

``moe_align`` groups the ``P = T * k`` pairs (pair ``p`` is token ``p // k``, slot ``p % k``)
by expert, each expert's group padded to a multiple of ``BLOCK_M`` so that a block of the
grouped GEMM reads one expert's weights. It runs on the device without a host sync and with
buffers sized from the shapes alone, so that CUDA graphs can capture it. The pairs are cut into
chunks of at most ``_CHUNK``; a chunk's rank of a pair inside its expert is a cumulative sum
over a one-hot ``[chunk, experts]`` matrix, and its place in the expert's group adds the counts
of the same expert in the chunks before it. So a first kernel writes every chunk's histogram,
and a second, a program per chunk, sums the histograms before its chunk and all of them (the
padded offsets, a cumulative sum over the experts), then scatters its pairs. Pairs keep their
order inside an expert's group, and no atomics are used: the layout is the same on every run.
With a single chunk (decode up to ``_CHUNK`` pairs) the second kernel counts for itself: one
launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.launch import launch

# Pairs per chunk of the alignment: the one-hot matrix is [_CHUNK, experts] per program.
_CHUNK = 128
# Histogram rows summed, and block experts written, at a time by the scatter programs.
_ROWS = 32


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride + lanes, mask=lanes < num_experts,
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    # Picked experts leave the race at -1, below every probability (padding lanes hold 0).
    probs = tl.where(lanes < num_experts, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        pick = tl.min(tl.where(probs == best, lanes, BLOCK_E), axis=0)
        top = tl.where(slots == slot, best, top)
        ids = tl.where(slots == slot, pick, ids)
        probs = tl.where(lanes == pick, -1.0, probs)
    if RENORMALIZE:
        top = top / tl.sum(top, axis=0)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.moe_route`` for ``router_logits [T, E]``: the top-k
    weights ``[T, k]`` in the logits' dtype and expert ids ``[T, k]`` int32."""
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=router_logits.dtype,
                          device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if tokens:
        launch(_moe_route_kernel, (tokens,), router_logits, weights, ids, experts,
               router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
               BLOCK_E=triton.next_power_of_2(experts),
               BLOCK_K=triton.next_power_of_2(top_k), num_warps=1)
    return weights, ids


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, CHUNK: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """The chunk's pair ids, their validity and their one-hot ``[CHUNK, BLOCK_E]`` experts."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    expert = tl.load(ids_ptr + pairs, mask=valid, other=num_experts).to(tl.int32)
    lanes = tl.arange(0, BLOCK_E)
    one_hot = ((expert[:, None] == lanes[None, :]) & valid[:, None]).to(tl.int32)
    return pairs, valid, one_hot


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(ids_ptr, hist_ptr, num_pairs, num_experts, CHUNK: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    _, _, one_hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, CHUNK, BLOCK_E)
    lanes = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + chunk * num_experts + lanes, tl.sum(one_hot, axis=0),
             mask=lanes < num_experts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _moe_scatter_kernel(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs,
                    num_experts, num_chunks, max_blocks, BLOCK_M: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                    SINGLE: tl.constexpr):
    chunk = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)
    pairs, valid, one_hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, CHUNK,
                                           BLOCK_E)
    if SINGLE:  # the only chunk: its own histogram is the whole count
        total = tl.sum(one_hot, axis=0)
        before = tl.zeros([BLOCK_E], tl.int32)
    else:
        total = tl.zeros([BLOCK_E], tl.int32)
        before = tl.zeros([BLOCK_E], tl.int32)
        for start in range(0, num_chunks, ROWS):
            rows = start + tl.arange(0, ROWS)
            hist = tl.load(hist_ptr + rows[:, None] * num_experts + lanes[None, :],
                           mask=(rows[:, None] < num_chunks) & (lanes[None, :] < num_experts),
                           other=0)
            total += tl.sum(hist, axis=0)
            before += tl.sum(tl.where(rows[:, None] < chunk, hist, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offsets = tl.cumsum(padded, axis=0) - padded
    # A pair's rank among its expert's pairs of the chunk, counting from 0.
    rank = tl.sum(one_hot * tl.cumsum(one_hot, axis=0), axis=1) - 1
    dest = tl.sum(one_hot * (offsets + before)[None, :], axis=1) + rank
    # A pair of expert -1 (on another rank, under expert parallelism) has no slot.
    tl.store(sorted_ptr + dest, pairs, mask=valid & (tl.sum(one_hot, axis=1) > 0))
    if chunk == 0:
        tl.store(used_ptr, tl.sum(padded, axis=0))
        # Each expert's padding slots (fewer than BLOCK_M) hold the sentinel num_pairs.
        pad = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + (offsets + total)[:, None] + pad[None, :],
                 tl.full([BLOCK_E, BLOCK_M], 0, tl.int32) + num_pairs,
                 mask=pad[None, :] < (padded - total)[:, None])
        # The expert of each of its blocks (an expert has at most max_blocks of them), ROWS
        # at a time: a bound known only at run time, so no token count compiles a variant.
        for start in range(0, max_blocks, ROWS):
            block = start + tl.arange(0, ROWS)
            tl.store(block_expert_ptr + (offsets // BLOCK_M)[:, None] + block[None, :],
                     tl.full([BLOCK_E, ROWS], 0, tl.int32) + lanes[:, None],
                     mask=block[None, :] < (padded // BLOCK_M)[:, None])


def max_slots(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Slots of the grouped layout: every pair, and less than a block of padding for each
    expert that can be hit (no more than there are pairs)."""
    pairs = num_tokens * top_k
    return pairs + min(num_experts, pairs) * (block_m - 1)


def moe_align(ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the pairs of ``ids [T, k]`` (each row's experts distinct) by expert.

    A pair of expert -1 is left out (an expert on another rank, under expert parallelism).
    Returns ``sorted_pairs [max_slots]`` int32 (each expert's pairs in order, then the
    sentinel ``T * k`` up to a multiple of ``block_m``; the experts one after another in
    index order), ``block_expert [max_slots // block_m]`` int32 (the expert of each block)
    and ``used [1]`` int32 (the slots in use, a multiple of ``block_m``). Slots and blocks
    past ``used`` are left unwritten.
    """
    tokens, top_k = ids.shape
    assert ids.is_contiguous()
    pairs = tokens * top_k
    slots = max_slots(tokens, top_k, num_experts, block_m)
    device = ids.device
    sorted_pairs = torch.empty(slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(slots // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    chunk = min(_CHUNK, max(16, triton.next_power_of_2(pairs)))
    chunks = triton.cdiv(pairs, chunk)
    block_e = triton.next_power_of_2(num_experts)
    hist = used  # unread with a single chunk
    if chunks > 1:
        hist = torch.empty((chunks, num_experts), dtype=torch.int32, device=device)
        launch(_moe_count_kernel, (chunks,), ids, hist, pairs, num_experts, CHUNK=chunk,
               BLOCK_E=block_e, num_warps=4)
    launch(_moe_scatter_kernel, (chunks,), ids, hist, sorted_pairs, block_expert, used, pairs,
           num_experts, chunks, triton.cdiv(tokens, block_m), BLOCK_M=block_m, CHUNK=chunk,
           BLOCK_E=block_e, ROWS=_ROWS, SINGLE=chunks == 1, num_warps=4)
    return sorted_pairs, block_expert, used
