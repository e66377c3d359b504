"""Token sampling with temperature, top-k, top-p and min-p, without sorting the vocabulary.

One program per row. Top-k and top-p each keep the tokens whose logit reaches a threshold, and
the kernel finds each threshold by searching the order-preserving int32 image of the float32
logits (temperature preserves the order, so raw logits serve): each pass over the row counts
(top-k) or weighs by probability (top-p) the tokens above ``PROBES`` candidate keys at once,
narrowing the interval ``PROBES``-fold: a 32-bit search takes 11 passes of 8 probes (more
probes per pass cost more registers and arithmetic than the passes they save). A token is kept
when the tokens strictly above it number fewer than ``k`` / hold less than ``top_p`` of the
mass, as in the reference, except that tokens tied at the threshold are all kept (the
reference's sort keeps an arbitrary subset of them). The draw is an exponential race:
``argmax(x / T - log E)`` with ``E ~ Exp(1)`` per token picks token ``i`` with probability
``softmax(x / T)_i`` over the kept set. Min-p keeps, of those, the tokens whose weight
``exp((x - max) / T)`` reaches ``min_p``: a test in the race against the row's maximum.

With a small ``top_k`` (at most ``KMAX``, as every Qwen3 checkpoint's ``top_k=20``) one pass
over the row instead keeps each lane's maximum over the row's tiles. The ``k`` largest logits
lie in the lanes whose maximum reaches the ``k``-th largest lane maximum (a lane holding one of
them has a maximum at least that large), so gathering those lanes' columns and searching them
for their own ``k``-th largest key gives the row's top-k threshold; top-p and the race then run
over the kept candidates in registers. One read of the row, and searches over register tensors
in place of sorts (a 4,096-lane sort cost the kernel more than reading the row). Lanes and
candidates are compacted through a small scratch row (their order: lane, then tile).

Greedy rows (temperature 0) take the argmax, lowest index on ties, in the same launch (in
small batches, torch's argmax before it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.launch import launch
from hf_paged.kernels.logit_keys import kth_key, narrow, probe_keys, tile, tiles, to_key

# (vocabulary tile, probes per pass over the row, warps)
_TILE = (4096, 8, 16)
# Probes per pass of the register searches: each pass costs its probes times the lanes in
# compares, with no memory to amortise (H100, 256 rows: 4 probes 124 us, 8 probes 134).
_REGISTER_PROBES = 4
# Tiles a lane-maximum pass loads at once (``tiles``).
_DEPTH = 4
# Up to this many rows torch's argmax, which spreads a row over many programs, takes greedy
# rows (H100: 9.3 us against one program's 17.9 at 1 row, 13.1 against 19.4 at 16; 22.4
# against 19.2 at 64): batch-1 greedy decoding is latency-bound.
_TORCH_ARGMAX_ROWS = 16
# Candidates kept by the one-pass top-k path: top_k up to this takes it.
KMAX = 64


@triton.jit
def _threshold(row_ptr, vocab, lo, hi, floor, row_max, log2e_over_t, bound,
               WEIGHTED: tl.constexpr, BLOCK_V: tl.constexpr, PROBES: tl.constexpr):
    """Smallest key ``v`` in ``(lo, hi]`` such that the tokens with key above ``v`` count, or
    when ``WEIGHTED`` those also at least ``floor`` weigh ``exp((x - row_max) / T)``, less than
    ``bound``. The test must fail at ``lo``; it is monotone in ``v``, so the answer is ``hi``
    if it never holds inside."""
    floor = floor.to(tl.int32)
    while hi - lo > 1:
        probes = probe_keys(lo, hi, PROBES)
        # Per-lane sums, reduced once after the pass.
        mass = tl.zeros([PROBES, BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            _, ok, x, key = tile(row_ptr, start, vocab, BLOCK_V)
            if WEIGHTED:
                weight = tl.where(ok & (key >= floor), tl.exp2((x - row_max) * log2e_over_t), 0.0)
            else:
                weight = tl.where(ok, 1.0, 0.0)
            mass += tl.where(key[None, :] > probes[:, None].to(tl.int32), weight[None, :], 0.0)
        lo, hi = narrow(lo, hi, probes, tl.sum(mass, axis=1) < bound)
    return hi


# Per-row settings may be views into a graph's packed inputs at any offset: their alignment
# is left out of the compiled variant (one variant for graphs and eager steps).
@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr",
                                            "min_p_ptr", "seed_ptr"])
def _sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, scratch_ptr, out_ptr,
    vocab, stride, BLOCK_V: tl.constexpr, PROBES: tl.constexpr, REGISTER_PROBES: tl.constexpr,
    K: tl.constexpr, NT: tl.constexpr, DEPTH: tl.constexpr, ARGMAX: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    if temperature <= 0:  # greedy: the argmax, unless the caller's stands
        if ARGMAX:
            _argmax(row_ptr, vocab, out_ptr + row, BLOCK_V, DEPTH)
        return
    log2e_over_t = 1.4426950408889634 / temperature
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    log2_min_p = tl.log2(tl.load(min_p_ptr + row))  # min_p 0: -inf, every token passes
    done = (top_k > 0) & (top_k <= K) & (top_k < vocab)
    if done:
        done = _sample_candidates(row_ptr, scratch_ptr + row.to(tl.int64) * 2 * K, vocab, top_k,
                                  top_p, log2_min_p, temperature, log2e_over_t, seed_ptr,
                                  out_ptr, row, BLOCK_V, K, NT, REGISTER_PROBES, DEPTH)
    if done:
        return

    floor = tl.full([], -(2**31), tl.int64)  # keys >= floor are kept
    row_max = tl.full([], 0.0, tl.float32)  # the largest logit, once min-p or top-p needs it
    if (top_k > 0) & (top_k < vocab):
        floor = _threshold(row_ptr, vocab, floor - 1, tl.full([], 2**31 - 1, tl.int64), floor,
                           0.0, log2e_over_t, top_k.to(tl.float32), False, BLOCK_V, PROBES)
    if top_p < 1.0:
        # Max and total probability weight of the kept logits, in one pass (online rescaling).
        run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            _, ok, x, key = tile(row_ptr, start, vocab, BLOCK_V)
            x = tl.where(ok & (key >= floor.to(tl.int32)), x, float("-inf"))
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp2((run_max - safe) * log2e_over_t) + tl.exp2(
                (x - safe) * log2e_over_t)
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        total = tl.sum(run_sum * tl.exp2((run_max - row_max) * log2e_over_t), axis=0)
        # top_p = 0 still keeps the most likely token, as in the reference.
        bound = tl.maximum(top_p, 1e-7) * total
        floor = _threshold(row_ptr, vocab, floor - 1, tl.full([], 2**31 - 1, tl.int64), floor,
                           row_max, log2e_over_t, bound, True, BLOCK_V, PROBES)
    elif log2_min_p > float("-inf"):
        lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for start in range(0, vocab, DEPTH * BLOCK_V):
            _, ok, x, _ = tiles(row_ptr, start, vocab, BLOCK_V, DEPTH)
            lane_max = tl.maximum(lane_max, tl.max(x, axis=0))
        row_max = tl.max(lane_max, axis=0)

    # The race, a tile at a time in four quarters: one Philox call gives the four quarters'
    # uniforms (a call per token made the race compute-bound, not read-bound).
    seed = tl.load(seed_ptr)
    QUARTER: tl.constexpr = BLOCK_V // 4
    lanes = tl.arange(0, QUARTER)
    counters = row * tl.cdiv(vocab, 4) + lanes
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    inv_t = 1.0 / temperature
    kept_from = floor.to(tl.int32)
    # Min-p as a logit bound: (x - max) / T >= ln(min_p); -inf when off.
    min_x = row_max + log2_min_p / log2e_over_t
    for start in range(0, vocab, BLOCK_V):
        u0, u1, u2, u3 = tl.rand4x(seed, counters + start // 4)
        best, best_idx = _race(row_ptr, start, vocab, u0, kept_from, min_x, inv_t, best,
                               best_idx, QUARTER)
        best, best_idx = _race(row_ptr, start + QUARTER, vocab, u1, kept_from, min_x, inv_t,
                               best, best_idx, QUARTER)
        best, best_idx = _race(row_ptr, start + 2 * QUARTER, vocab, u2, kept_from, min_x,
                               inv_t, best, best_idx, QUARTER)
        best, best_idx = _race(row_ptr, start + 3 * QUARTER, vocab, u3, kept_from, min_x,
                               inv_t, best, best_idx, QUARTER)
    winner = tl.argmax(best, axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(lanes == winner, best_idx, 0), 0))


@triton.jit
def _argmax(row_ptr, vocab, out_ptr, BLOCK_V: tl.constexpr, DEPTH: tl.constexpr):
    """The row's largest logit's index, the lowest on ties (as ``torch.argmax``): lanes keep
    their largest (key, -index) pair."""
    best = tl.full([BLOCK_V], -(2**63), tl.int64)
    for start in range(0, vocab, DEPTH * BLOCK_V):
        idx, ok, _, key = tiles(row_ptr, start, vocab, BLOCK_V, DEPTH)
        packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)
        best = tl.maximum(best, tl.max(tl.where(ok, packed, -(2**63)), axis=0))
    tl.store(out_ptr, 0x7FFFFFFF - (tl.max(best, axis=0) & 0xFFFFFFFF))


@triton.jit
def _sample_candidates(row_ptr, scratch, vocab, top_k, top_p, log2_min_p, temperature,
                       log2e_over_t, seed_ptr, out_ptr, row, BLOCK_V: tl.constexpr,
                       K: tl.constexpr, NT: tl.constexpr, PROBES: tl.constexpr,
                       DEPTH: tl.constexpr):
    """Top-k, top-p, min-p and the draw over the row's ``k`` largest logits, found in one pass
    (``scratch``: this row's ``2 * K`` int32); False, storing nothing, when ties let more than
    ``K`` lanes or candidates through (the searching path then serves the row)."""
    best = tl.full([BLOCK_V], -(2**31), tl.int32)  # each lane's largest key
    for start in range(0, vocab, DEPTH * BLOCK_V):
        _, ok, _, key = tiles(row_ptr, start, vocab, BLOCK_V, DEPTH)
        best = tl.maximum(best, tl.max(tl.where(ok, key, -(2**31)), axis=0))
    # The lanes reaching the k-th largest lane maximum, compacted into K slots.
    chosen = best >= kth_key(best, top_k, PROBES)
    num_lanes = tl.sum(chosen.to(tl.int32), axis=0)
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(scratch + at, tl.arange(0, BLOCK_V), mask=chosen & (at < K))
    tl.debug_barrier()  # the slots are read by other threads than wrote them
    slots = tl.arange(0, K)
    lane = tl.load(scratch + slots, mask=slots < num_lanes, other=0)
    # Their columns, NT tiles deep (a power of two covering the row's tiles): the k-th largest
    # key among them is the row's.
    idx = tl.reshape(tl.arange(0, NT)[None, :] * BLOCK_V + lane[:, None], [K * NT])
    ok = tl.reshape(tl.broadcast_to((slots < num_lanes)[:, None], [K, NT]), [K * NT])
    ok = ok & (idx < vocab)
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
    key = tl.where(ok, to_key(x), -(2**31))
    chosen = key >= kth_key(key, top_k, PROBES)  # tokens tied at the k-th are all kept
    count = tl.sum(chosen.to(tl.int32), axis=0)
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(scratch + K + at, idx, mask=chosen & (at < K))
    tl.debug_barrier()
    kept = slots < count
    cidx = tl.load(scratch + K + slots, mask=kept, other=0)
    x = tl.load(row_ptr + cidx, mask=kept, other=float("-inf")).to(tl.float32)
    ckey = to_key(x)
    row_max = tl.max(x, axis=0)
    weight = tl.where(kept, tl.exp2((x - row_max) * log2e_over_t), 0.0)
    if top_p < 1.0:
        # A token stays while the tokens strictly above it hold less than top_p of the mass.
        bound = tl.maximum(top_p, 1e-7) * tl.sum(weight, axis=0)
        above = tl.sum(tl.where(ckey[None, :] > ckey[:, None], weight[None, :], 0.0), axis=1)
        kept = kept & (above < bound)
    kept = kept & ((x - row_max) * log2e_over_t >= log2_min_p)
    u = tl.rand(tl.load(seed_ptr), row * K + slots)
    score = tl.where(kept, x / temperature - tl.log(-tl.log(u)), float("-inf"))
    winner = tl.argmax(score, axis=0)
    fits = (num_lanes <= K) & (count <= K)
    tl.store(out_ptr + row, tl.sum(tl.where(slots == winner, cidx, 0), axis=0), mask=fits)
    return fits


@triton.jit
def _race(row_ptr, start, vocab, u, kept_from, min_x, inv_t, best, best_idx,
          BLOCK: tl.constexpr):
    """One block of the exponential race: each kept token (key at least ``kept_from``, logit
    at least ``min_x``) scores ``x / T - log E`` with ``E = -log u ~ Exp(1)`` (``u = 0`` gives
    an infinite E: it never wins); lanes keep their best score and its token."""
    idx, ok, x, key = tile(row_ptr, start, vocab, BLOCK)
    kept = ok & (key >= kept_from) & (x >= min_x)
    score = tl.where(kept, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
    wins = score > best
    return tl.where(wins, score, best), tl.where(wins, idx, best_idx)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.sample``; no host sync.

    ``generator`` (on the logits' device) seeds the random stream of the call.
    """
    assert logits.stride(-1) == 1
    rows, vocab = logits.shape
    torch_argmax = rows <= _TORCH_ARGMAX_ROWS
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if torch_argmax:
        torch.argmax(logits, -1, out=out)
    seed = torch.randint(2**31 - 1, (1,), device=logits.device, generator=generator)
    if min_p is None:
        min_p = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    block_v, probes, num_warps = _TILE
    block_v = min(block_v, max(16, triton.next_power_of_2(vocab)))
    k = min(KMAX, block_v)
    scratch = torch.empty((rows, 2 * k), dtype=torch.int32, device=logits.device)
    if rows:
        launch(
            _sample_kernel, (rows,),
            logits, temperature, top_k, top_p, min_p, seed, scratch, out, vocab,
            logits.stride(0),
            BLOCK_V=block_v, PROBES=probes, REGISTER_PROBES=_REGISTER_PROBES, K=k, DEPTH=_DEPTH,
            ARGMAX=not torch_argmax,
            NT=triton.next_power_of_2(triton.cdiv(vocab, block_v)), num_warps=num_warps,
        )
    return out
