"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5) over a continuous
batch, each sequence's recurrent state ``[Hv, K, V]`` float32 in a pool slot: the chunked
prefill and the one-token decode (twins: ``reference_gated_delta``).

Prefill: one program per (sequence, value head, V tile) walks its sequence's chunks of 64
tokens in order, the state's ``[K, BV]`` tile in registers. Per chunk, as flash-linear-
attention's ``chunk_gated_delta_rule`` (the WY representation of the chunk's delta-rule
updates; the UT transform):

1. ``gc`` = cumulative log decay in the chunk; ``D[i, j] = exp(gc_i - gc_j)`` for ``i >= j``;
2. ``A = (beta k) k^T * D``, strictly lower; ``T = (I + A)^-1`` by forward substitution;
3. ``u = T (beta v)``, ``w = T (beta k exp(gc))``: the chunk's updates as if it started
   from a zero state, and what the incoming state ``S`` predicts of them;
4. ``v_new = u - w S``; ``o = (q exp(gc)) S + ((q k^T) * D) v_new``;
5. ``S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new``.

A faster prefill would do what flash-linear-attention does: steps 1-3 in kernels parallel
over every chunk of every sequence (``T`` from 16x16 diagonal blocks inverted by substitution
and merged by products on the tensor cores, instead of the 63 serial row steps here, which
every V tile of a head repeats), then a state pass that only stores each chunk's incoming
state, then the outputs, again parallel over chunks. Here a long prompt of a few sequences
runs as ``B * Hv * V/BV`` programs, each through its chunks one after another.

Decode: one program per (sequence, value head, V tile) reads its state tile, applies the
token's update and writes it back; a negative slot (a padding row of a CUDA-graph batch)
writes a zero output and no state. A prefill sequence with a negative slot (a CUDA graph's
padding sequence, empty) starts from zeros and keeps no state. Neither kernel reads a value on
the host, and their grids follow the shapes alone: a CUDA graph replays them for any lengths
and slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.kernels.gdc import pdl_options, wait_for_previous
from hf_paged.kernels.launch import launch
from hf_paged.kernels.reference_gated_delta import CHUNK, L2NORM_EPS, check_gated_delta

# V tiles. Prefill: 32 columns keep the state tile ([128, 32] float32, Qwen3-Next's K) at 16
# KB beside the chunk's q, k ([64, 128] each) and the 64x64 matrices; more programs for the
# few sequences of a prefill, at the cost of repeating steps 1-3 per tile. Decode: 32 columns
# give B * Hv * V/32 programs (128 a sequence for Qwen3-Next), enough to spread one
# sequence's state read (Hv * K * V * 4 bytes, 2 MB) over the SMs.
_PREFILL_BV = 32
_DECODE_BV = 32
_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _unit_lower_inverse(a, C: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower triangular ``a [C, C]``: row ``i`` of the inverse
    ``X`` is ``e_i - sum_{j<i} a[i, j] X[j]`` (``X = I - a X``), one row a step. Rows are
    picked by masked sums (registers cannot be indexed); ``a``'s row ``i`` is taken as
    column ``i`` of its transpose, so that it lies along the axis the product sums over."""
    rows = tl.arange(0, C)
    a_t = tl.trans(a)
    x = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows[None, :] == i, a_t, 0.0), axis=1)
        below = tl.sum(a_i[:, None] * x, axis=0)
        x = tl.where(rows[:, None] == i, x - below[None, :], x)
    return x


@triton.jit
def _l2norm(x, ON: tl.constexpr):
    """transformers' l2norm along the last axis (``x * rsqrt(sum(x*x) + eps)``), if ``ON``."""
    if ON:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + _EPS))
    return x


# No argument varies with the batch but the pointers and cu_seqlens' values: a new batch
# compiles nothing new.
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, cu_ptr, pool_ptr, slots_ptr, initial_ptr,
    scale, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, b_s0, o_s0, o_s1, p_s0, p_s1, p_s2,
    REPEATS: tl.constexpr, L2NORM: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // REPEATS  # transformers' repeat_interleave of q and k over value heads
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
        # Rows past the sequence load as zeros (g = 0: no decay; k = 0: no update), as
        # transformers' zero padding: they change neither the state nor the other rows.
        first = start.to(tl.int64) + c * C  # 64-bit bases, 32-bit offsets within the chunk
        r_ok = rows < end - first
        qk_mask = r_ok[:, None] & k_ok[None, :]
        # Registers: q and k ([64, K] float32, the largest values) are the only chunk-by-K
        # values. The diagonal scalings (beta, exp(gc)) go on the [64, 64] and [64, BV]
        # operands instead of the [64, K] ones: (beta k) k^T = beta * (k k^T),
        # T (beta exp(gc) k) = (T beta exp(gc)) k, and so on. The inverse needs k, g and beta
        # alone; v, then q, are loaded after it (the compiler keeps program order).
        k = tl.load(k_ptr + first * k_s0 + kv_head * k_s1 + (rows[:, None] * k_s0 + ks[None, :]),
                    mask=qk_mask, other=0.0)
        g = tl.load(g_ptr + first * g_s0 + head + rows * g_s0, mask=r_ok, other=0.0)
        beta = tl.load(beta_ptr + first * b_s0 + head + rows * b_s0, mask=r_ok,
                       other=0.0).to(tl.float32)
        k = _l2norm(k.to(tl.float32), L2NORM)
        gc = tl.cumsum(g, axis=0)
        # exp of the masked difference, as transformers: above the diagonal it would overflow
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        a = tl.dot(k, tl.trans(k), input_precision=PRECISION) * (beta[:, None] * decay)
        t = _unit_lower_inverse(tl.where(rows[:, None] > rows[None, :], a, 0.0), C)
        t_beta = t * beta[None, :]
        w = tl.dot(t_beta * tl.exp(gc)[None, :], k, input_precision=PRECISION)
        v = tl.load(v_ptr + first * v_s0 + head * v_s1 + (rows[:, None] * v_s0 + vs[None, :]),
                    mask=r_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        v_new = tl.dot(t_beta, v, input_precision=PRECISION)
        v_new -= tl.dot(w, state, input_precision=PRECISION)
        q = tl.load(q_ptr + first * q_s0 + kv_head * q_s1 + (rows[:, None] * q_s0 + ks[None, :]),
                    mask=qk_mask, other=0.0)
        q = _l2norm(q.to(tl.float32), L2NORM) * scale
        attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(q, state, input_precision=PRECISION) * tl.exp(gc)[:, None]
        out = tl.dot(attn, v_new, out, input_precision=PRECISION)
        o_ptrs = out_ptr + first * o_s0 + head * o_s1 + (rows[:, None] * o_s0 + vs[None, :])
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & v_ok[None, :])
        # the last row's cumulative decay (padding rows repeat the last real one's)
        g_last = tl.sum(tl.where(rows == C - 1, gc, 0.0), axis=0)
        v_decayed = v_new * tl.exp(g_last - gc)[:, None]
        state = tl.dot(tl.trans(k), v_decayed, state * tl.exp(g_last), input_precision=PRECISION)
    tl.store(s_ptrs, state, mask=tl.where(live, s_mask, False))


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, initial_ptr, scale,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, b_s0, o_s0, o_s1, p_s0, p_s1, p_s2,
    REPEATS: tl.constexpr, L2NORM: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_head = head // REPEATS
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # masks, not an early return: a padding row still writes its zeros
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K_DIM, vs < V_DIM
    q = tl.load(q_ptr + seq * q_s0 + kv_head * q_s1 + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * k_s0 + kv_head * k_s1 + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * v_s0 + head * v_s1 + vs, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * g_s0 + head)
    beta = tl.load(beta_ptr + seq * b_s0 + head).to(tl.float32)
    q = _l2norm(q, L2NORM) * scale
    k = _l2norm(k, L2NORM)
    s_ptrs = (pool_ptr + tl.maximum(slot, 0) * p_s0 + head * p_s1
              + (ks[:, None] * p_s2 + vs[None, :]))
    s_mask = tl.where(live, k_ok[:, None] & v_ok[None, :], False)
    reads = s_mask
    if HAS_INITIAL:  # a sequence's first token starts from zeros, not the slot
        reads = tl.where(tl.load(initial_ptr + seq) != 0, s_mask, False)
    state = tl.load(s_ptrs, mask=reads, other=0.0) * tl.exp(g)
    # transformers' order: decay, read the key's prediction, write the correction, read q
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * delta[None, :]
    out = tl.where(live, tl.sum(state * q[:, None], axis=0), 0.0)
    tl.store(out_ptr + seq * o_s0 + head * o_s1 + vs, out.to(out_ptr.dtype.element_ty),
             mask=v_ok)
    tl.store(s_ptrs, state, mask=s_mask)


def _strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, out: torch.Tensor, state_pool: torch.Tensor) -> tuple[int, ...]:
    """The strides both kernels take; every last dimension must be contiguous (wide loads)."""
    for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool).items():
        if x.stride(-1) != 1:
            raise ValueError(f"gated delta kernels: {name}'s last dimension is not contiguous")
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), out.stride(0), out.stride(1), *state_pool.stride()[:3])


def _heads(q: torch.Tensor, v: torch.Tensor, tile: int) -> dict[str, int]:
    k_dim, v_dim = q.shape[2], v.shape[2]
    block_v = min(max(triton.next_power_of_2(v_dim), 16), tile)  # tl.dot's least is 16
    return dict(REPEATS=v.shape[1] // q.shape[1], K_DIM=k_dim, V_DIM=v_dim,
                BK=max(triton.next_power_of_2(k_dim), 16), BV=block_v)


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                        slots: torch.Tensor, has_initial: torch.Tensor,
                        use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """Triton twin of ``reference.gated_delta_prefill`` (same arguments and result)."""
    check_gated_delta("gated_delta_prefill", q, k, v, g, beta, state_pool, slots, cu_seqlens,
                      has_initial)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if slots.numel() == 0:
        return out
    if has_initial.dtype == torch.bool:
        has_initial = has_initial.view(torch.uint8)  # a view: no launch, no copy
    shapes = _heads(q, v, _PREFILL_BV)
    # float32 products in full precision, as torch's; from 16-bit inputs the TF32 tensor cores
    # (operands rounded to 11 bits, below the 16-bit output's 8; the inverse's entries and the
    # state are float32 either way, and the delta rule's update does not grow them)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch(_prefill_kernel, (slots.numel(), v.shape[1], triton.cdiv(v.shape[2], shapes["BV"])),
           q, k, v, g, beta, out, cu_seqlens, state_pool, slots, has_initial,
           q.shape[2] ** -0.5 if scale is None else scale,
           *_strides(q, k, v, g, beta, out, state_pool), L2NORM=use_qk_l2norm, C=CHUNK,
           PRECISION=precision, num_warps=8, num_stages=1, **pdl_options(q), **shapes)
    # (Compiled for sm_90 from bf16 inputs, Qwen3-Next's K = V = 128: eight warps take 255
    # registers a thread and spill 620 bytes, four spill 1,028, sixteen 1,696 at 128; the
    # loads, not the 63-step inverse, hold the registers (without its steps: the same). One
    # stage: the chunk loop carries the state, there is nothing to prefetch. float32 inputs,
    # on the FMA units in full precision, spill about 30 KB: a parity path, not a fast one.)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                       use_qk_l2norm: bool = True, scale: float | None = None,
                       has_initial: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``reference.gated_delta_decode`` (same arguments and result)."""
    check_gated_delta("gated_delta_decode", q, k, v, g, beta, state_pool, slots,
                      has_initial=has_initial)
    if has_initial is not None and has_initial.dtype == torch.bool:
        has_initial = has_initial.view(torch.uint8)  # a view: no launch, no copy
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if slots.numel() == 0:
        return out
    shapes = _heads(q, v, _DECODE_BV)
    launch(_decode_kernel, (slots.numel(), v.shape[1], triton.cdiv(v.shape[2], shapes["BV"])),
           q, k, v, g, beta, out, state_pool, slots,
           slots if has_initial is None else has_initial,
           q.shape[2] ** -0.5 if scale is None else scale,
           *_strides(q, k, v, g, beta, out, state_pool), L2NORM=use_qk_l2norm,
           HAS_INITIAL=has_initial is not None, num_warps=4, **pdl_options(q), **shapes)
    return out
