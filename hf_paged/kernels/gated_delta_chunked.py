"""The gated delta rule's chunked prefill over a continuous batch (twin:
``reference_gated_delta.gated_delta_prefill``), in two kernels, as flash-linear-attention
splits ``chunk_gated_delta_rule``: what each chunk of 64 tokens needs from itself alone, for
every chunk of every sequence at once, then a pass that carries each sequence's state through
its chunks in order.

Per chunk (the WY representation of its delta-rule updates; the UT transform):

1. ``gc`` = cumulative log decay in the chunk; ``D[i, j] = exp(gc_i - gc_j)`` for ``i >= j``;
2. ``A = (beta k) k^T * D``, strictly lower; ``T = (I + A)^-1`` by forward substitution;
3. ``u = T (beta v)``, ``w = T (beta k exp(gc))``: the chunk's updates as if it started
   from a zero state, and what the incoming state ``S`` predicts of them;
4. ``v_new = u - w S``; ``o = (q exp(gc)) S + ((q k^T) * D) v_new``;
5. ``S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new``.

``_chunk_kernel`` does 1-3, one program per (chunk, value head), and keeps ``w`` and ``u``
(float32, a row per token). Steps 1-3 hold the serial part (the inverse's 63 row steps):
parallel over chunks they cost one chunk's time, where a state pass doing them would pay them
once per chunk of the longest sequence, and once more per V tile. ``_state_kernel`` does 4-5,
one program per (sequence, value head, V tile), its ``[K, BV]`` state tile in registers.
Neither reads a value on the host, and their grids follow the shapes alone: a CUDA graph
replays them for any lengths and slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gated_delta import heads_shapes, l2norm, strides, unit_lower_inverse
from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_gated_delta import CHUNK, check_gated_delta

# The state pass's V tile and warps, one choice for every batch: a prefill graph pads its
# sequences (to eight or more), and a tile chosen by their count would make the graph's
# products differ from the same step's run eagerly. Measured on an H100 at Qwen3.5-9B's
# linear layers (32 value heads, K = V = 128): 64 columns on eight warps take 0.72 ms for
# eight 1,024-token sequences or 64 of 128 (32 on four: 1.15), 0.18 ms for a lone one (0.14).
_STATE_BV, _STATE_WARPS = 64, 8
# The chunk kernel's warps: its serial inverse (63 row steps over a [64, 64] tile) syncs fewer
# threads on two warps: 0.64 ms against 1.06 on eight for eight 1,024-token sequences.
_CHUNK_WARPS = 2
_SEQ_BLOCK = 64  # sequences read a step while a chunk program finds its sequence


@triton.jit
def _chunk_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, cu_ptr, seqs,
    k_s0, k_s1, v_s0, v_s1, g_s0, b_s0, w_s0, w_s1, u_s0, u_s1,
    REPEATS: tl.constexpr, L2NORM: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, C: tl.constexpr, SEQ_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    chunk, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // REPEATS  # transformers' repeat_interleave of q and k over value heads
    # This chunk's sequence: the number of sequences whose chunks all come before it, and
    # those chunks' count (the grid has a program for every chunk the batch can hold).
    seq = chunk * 0  # int32 scalars, as the loop carries them
    before = chunk * 0
    total = chunk * 0
    for s0 in range(0, seqs, SEQ_BLOCK):
        idx = s0 + tl.arange(0, SEQ_BLOCK)
        ok = idx < seqs
        lens = tl.load(cu_ptr + idx + 1, mask=ok, other=0) - tl.load(cu_ptr + idx, mask=ok,
                                                                      other=0)
        through = tl.cumsum(tl.cdiv(lens, C), axis=0) + total  # chunks up to each sequence
        done = ok & (through <= chunk)
        seq += tl.sum(done.to(tl.int32), axis=0)
        before = tl.maximum(before, tl.max(tl.where(done, through, 0), axis=0))
        total = tl.max(tl.where(ok, through, total), axis=0)
    if seq < seqs:
        end = tl.load(cu_ptr + seq + 1)
        first = tl.load(cu_ptr + seq).to(tl.int64) + (chunk - before) * C
        rows = tl.arange(0, C)
        ks, vs = tl.arange(0, BK), tl.arange(0, BVF)
        k_ok, v_ok = ks < K_DIM, vs < V_DIM
        # Rows past the sequence load as zeros (g = 0: no decay; k = 0: no update), as
        # transformers' zero padding: they change no other row.
        r_ok = rows < end - first
        k = tl.load(k_ptr + first * k_s0 + kv_head * k_s1 + (rows[:, None] * k_s0 + ks[None, :]),
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptr + first * g_s0 + head + rows * g_s0, mask=r_ok, other=0.0)
        beta = tl.load(beta_ptr + first * b_s0 + head + rows * b_s0, mask=r_ok,
                       other=0.0).to(tl.float32)
        k = l2norm(k.to(tl.float32), L2NORM)
        gc = tl.cumsum(g, axis=0)
        # exp of the masked difference, as transformers: above the diagonal it would overflow
        causal = rows[:, None] >= rows[None, :]
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        # (beta k) k^T = beta * (k k^T): the diagonal scalings go on the [64, 64] operands
        a = tl.dot(k, tl.trans(k), input_precision=PRECISION) * (beta[:, None] * decay)
        t_beta = unit_lower_inverse(tl.where(rows[:, None] > rows[None, :], a, 0.0), C)
        t_beta = t_beta * beta[None, :]
        w = tl.dot(t_beta * tl.exp(gc)[None, :], k, input_precision=PRECISION)
        tl.store(w_ptr + first * w_s0 + head * w_s1 + (rows[:, None] * w_s0 + ks[None, :]), w,
                 mask=r_ok[:, None] & k_ok[None, :])
        v = tl.load(v_ptr + first * v_s0 + head * v_s1 + (rows[:, None] * v_s0 + vs[None, :]),
                    mask=r_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        u = tl.dot(t_beta, v, input_precision=PRECISION)
        tl.store(u_ptr + first * u_s0 + head * u_s1 + (rows[:, None] * u_s0 + vs[None, :]), u,
                 mask=r_ok[:, None] & v_ok[None, :])


# No argument varies with the batch but the pointers and cu_seqlens' values: a new batch
# compiles nothing new.
@triton.jit
def _state_kernel(
    q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, out_ptr, cu_ptr, pool_ptr, slots_ptr, initial_ptr,
    scale, q_s0, q_s1, k_s0, k_s1, g_s0, w_s0, w_s1, u_s0, u_s1, o_s0, o_s1, p_s0, p_s1, p_s2,
    REPEATS: tl.constexpr, L2NORM: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // REPEATS
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # a padding sequence's -1: zeros in, nothing kept
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K_DIM, vs < V_DIM
    s_ptrs = (pool_ptr + tl.maximum(slot, 0) * p_s0 + head * p_s1
              + (ks[:, None] * p_s2 + vs[None, :]))
    s_mask = k_ok[:, None] & v_ok[None, :]
    # a new sequence starts from zeros, whatever its slot held
    # (a scalar condition through tl.where: Triton's interpreter refuses ``block & scalar``)
    initial = (tl.load(initial_ptr + seq) != 0) & live
    state = tl.load(s_ptrs, mask=tl.where(initial, s_mask, False), other=0.0)
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    for c in range(0, tl.cdiv(end - start, C)):
        first = start.to(tl.int64) + c * C  # 64-bit bases, 32-bit offsets within the chunk
        r_ok = rows < end - first
        qk_mask = r_ok[:, None] & k_ok[None, :]
        rv_mask = r_ok[:, None] & v_ok[None, :]
        w = tl.load(w_ptr + first * w_s0 + head * w_s1 + (rows[:, None] * w_s0 + ks[None, :]),
                    mask=qk_mask, other=0.0)
        u = tl.load(u_ptr + first * u_s0 + head * u_s1 + (rows[:, None] * u_s0 + vs[None, :]),
                    mask=rv_mask, other=0.0)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)
        g = tl.load(g_ptr + first * g_s0 + head + rows * g_s0, mask=r_ok, other=0.0)
        gc = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        k = tl.load(k_ptr + first * k_s0 + kv_head * k_s1 + (rows[:, None] * k_s0 + ks[None, :]),
                    mask=qk_mask, other=0.0)
        k = l2norm(k.to(tl.float32), L2NORM)
        q = tl.load(q_ptr + first * q_s0 + kv_head * q_s1 + (rows[:, None] * q_s0 + ks[None, :]),
                    mask=qk_mask, other=0.0)
        q = l2norm(q.to(tl.float32), L2NORM) * scale
        attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(q, state, input_precision=PRECISION) * tl.exp(gc)[:, None]
        out = tl.dot(attn, v_new, out, input_precision=PRECISION)
        o_ptrs = out_ptr + first * o_s0 + head * o_s1 + (rows[:, None] * o_s0 + vs[None, :])
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=rv_mask)
        # the last row's cumulative decay (padding rows repeat the last real one's)
        g_last = tl.sum(tl.where(rows == C - 1, gc, 0.0), axis=0)
        v_decayed = v_new * tl.exp(g_last - gc)[:, None]
        state = tl.dot(tl.trans(k), v_decayed, state * tl.exp(g_last), input_precision=PRECISION)
    tl.store(s_ptrs, state, mask=tl.where(live, s_mask, False))


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                        slots: torch.Tensor, has_initial: torch.Tensor,
                        use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """Triton twin of ``reference.gated_delta_prefill`` (same arguments and result)."""
    check_gated_delta("gated_delta_prefill", q, k, v, g, beta, state_pool, slots, cu_seqlens,
                      has_initial)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    seqs = slots.numel()
    if seqs == 0:
        return out
    if has_initial.dtype == torch.bool:
        has_initial = has_initial.view(torch.uint8)  # a view: no launch, no copy
    tokens, heads, v_dim = v.shape
    # float32 products in full precision, as torch's; from 16-bit inputs the TF32 tensor cores
    # (operands rounded to 11 bits, below the 16-bit output's 8; the inverse's entries and the
    # state are float32 either way, and the delta rule's update does not grow them)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(L2NORM=use_qk_l2norm, C=CHUNK, PRECISION=precision, **pdl_options(q))
    w = torch.empty(tokens, heads, q.shape[2], dtype=torch.float32, device=q.device)
    u = torch.empty(tokens, heads, v_dim, dtype=torch.float32, device=q.device)
    full = heads_shapes(q, v, triton.next_power_of_2(v_dim))
    # every chunk the batch can hold: each sequence adds at most one part-filled chunk
    launch(_chunk_kernel, (triton.cdiv(tokens, CHUNK) + seqs, heads),
           k, v, g, beta, w, u, cu_seqlens, seqs, k.stride(0), k.stride(1), v.stride(0),
           v.stride(1), g.stride(0), beta.stride(0), w.stride(0), w.stride(1), u.stride(0),
           u.stride(1), REPEATS=full["REPEATS"], K_DIM=full["K_DIM"], V_DIM=v_dim,
           BK=full["BK"], BVF=full["BV"], SEQ_BLOCK=_SEQ_BLOCK, num_warps=_CHUNK_WARPS,
           num_stages=1, **common)
    shapes = heads_shapes(q, v, _STATE_BV)
    q_s0, q_s1, k_s0, k_s1, _, _, g_s0, _, o_s0, o_s1, *pool = strides(q, k, v, g, beta, out,
                                                                       state_pool)
    launch(_state_kernel, (seqs, heads, triton.cdiv(v_dim, shapes["BV"])),
           q, k, g, w, u, out, cu_seqlens, state_pool, slots, has_initial,
           q.shape[2] ** -0.5 if scale is None else scale,
           q_s0, q_s1, k_s0, k_s1, g_s0, w.stride(0), w.stride(1), u.stride(0), u.stride(1),
           o_s0, o_s1, *pool, num_warps=_STATE_WARPS, num_stages=1, **common, **shapes)
    return out
