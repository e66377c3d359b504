"""Plain-torch twins of the Gated DeltaNet kernels (the linear-attention layers of Qwen3-Next and
Qwen3.5) over a continuous batch whose sequences each keep a recurrent state in a pool's slot
(``reference`` re-exports them beside every other twin).

Numerics are transformers' ``torch_chunk_gated_delta_rule`` (prefill) and
``torch_recurrent_gated_delta_rule`` (decode), cast points included: everything in float32,
query and key L2-normalised with its eps, the query scaled by ``K ** -0.5``, chunks of 64
tokens, the chunk's triangular system solved by ``solve_triangular``. The state is
``[H, K, V]`` float32, as transformers keeps it: ``S_t = exp(g_t) S_{t-1} + k_t (beta_t
(v_t - k_t^T exp(g_t) S_{t-1}))^T`` and ``o_t = S_t^T q_t``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk size: the same chunking gives the same rounding
L2NORM_EPS = 1e-6  # transformers' (and flash-linear-attention's) l2norm eps


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's per-token, per-head gates from the projections ``a``, ``b`` ``[T, H]``
    as transformers computes them: the log decay ``g = -exp(A_log) * softplus(a + dt_bias)``
    in float32 (``A_log`` in half precision would overflow), and ``beta = sigmoid(b)`` in
    ``b``'s dtype."""
    check_gates(a, b, a_log, dt_bias)
    g = (-a_log.float().exp() * F.softplus(a.float() + dt_bias)).float()
    return g, b.sigmoid()


def check_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor) -> None:
    """Raise a ValueError naming the gates' arguments unless they are ``[T, H]``, ``[T, H]``,
    ``[H]`` and ``[H]`` (both twins call it)."""
    heads = a.shape[-1]
    if a.dim() != 2 or b.shape != a.shape or a_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"gated_delta_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log "
                         f"{tuple(a_log.shape)} and dt_bias {tuple(dt_bias.shape)} are not "
                         "[T, H], [T, H], [H] and [H]")


def check_gated_delta(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor,
                      slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      has_initial: torch.Tensor | None = None) -> None:
    """Raise a ValueError naming the first argument of ``name`` whose shape or dtype does not
    fit the others (both twins call it; values on the device are not read)."""
    tokens, kv_heads, k_dim = q.shape
    heads, v_dim = v.shape[1:]
    seqs = slots.numel()
    problems = {
        "k": f"{tuple(k.shape)} is not q's {tuple(q.shape)}" if k.shape != q.shape else None,
        "v": (f"{tuple(v.shape)} is not [{tokens}, Hv, V] with Hv a multiple of {kv_heads}"
              if v.dim() != 3 or v.shape[0] != tokens or heads % kv_heads else None),
        "g": (f"{tuple(g.shape)} {g.dtype} is not [{tokens}, {heads}] float32"
              if g.shape != (tokens, heads) or g.dtype != torch.float32 else None),
        "beta": f"{tuple(beta.shape)} is not [{tokens}, {heads}]"
                if beta.shape != (tokens, heads) else None,
        "state_pool": (f"{tuple(state_pool.shape)} {state_pool.dtype} is not "
                       f"[slots, {heads}, {k_dim}, {v_dim}] float32"
                       if state_pool.shape[1:] != (heads, k_dim, v_dim)
                       or state_pool.dtype != torch.float32 else None),
        "slots": (f"{tuple(slots.shape)} is not [{tokens}] (a token a sequence)"
                  if cu_seqlens is None and slots.shape != (tokens,) else None),
    }
    if cu_seqlens is not None:
        problems["cu_seqlens"] = (f"{tuple(cu_seqlens.shape)} is not [{seqs + 1}]"
                                  if cu_seqlens.shape != (seqs + 1,) else None)
    if has_initial is not None:
        problems["has_initial"] = (f"{tuple(has_initial.shape)} is not [{seqs}]"
                                   if has_initial.shape != (seqs,) else None)
    for arg, problem in problems.items():
        if problem:
            raise ValueError(f"{name}: {arg} {problem}")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``l2norm`` (flash-linear-attention's): ``x * rsqrt(sum(x*x) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _float_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """``[T, H, D]`` / ``[T, H]`` inputs as transformers prepares them, heads first: q and k
    repeated over their value heads (``repeat_interleave``: value head ``h`` reads key head
    ``h // (Hv // Hk)``), all float32, q and k L2-normalised. Query unscaled."""
    repeats = v.shape[1] // k.shape[1]
    if repeats != 1:
        q, k = q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)
    q, k, v, g, beta = (x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q, k, v, g, beta


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads first (``q, k [H, T, K]``, scaled and normalised; ``v [H, T, V]``;
    ``g, beta [H, T]``) from ``state [H, K, V]``, as ``torch_chunk_gated_delta_rule`` computes
    it: returns the float32 output ``[H, T, V]`` and the final state."""
    heads, length, _ = k.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, -1, CHUNK, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, -1, CHUNK).cumsum(dim=-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False,
                                               unitriangular=True)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                        slots: torch.Tensor, has_initial: torch.Tensor,
                        use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """The gated delta rule over a packed batch (``torch_chunk_gated_delta_rule`` per sequence).

    ``q, k [T, Hk, K]``, ``v [T, Hv, V]`` (Hv a multiple of Hk), ``g [T, Hv]`` float32 (the log
    decay, at most 0), ``beta [T, Hv]``; sequence ``i`` owns rows ``cu_seqlens[i]:
    cu_seqlens[i+1]`` (int32 ``[B+1]``). It starts from ``state_pool[slots[i]]`` (float32
    ``[N, Hv, K, V]``) where ``has_initial[i]`` (a continued prefill chunk), else from zeros,
    and its final state is written to that slot in place. Slots must be distinct; a negative
    one (a CUDA graph's padding sequence) starts from zeros and keeps nothing.
    ``scale``: the query's (None: ``K ** -0.5``). Returns ``[T, Hv, V]`` in q's dtype; rows
    past ``cu_seqlens[-1]`` are not written.
    """
    check_gated_delta("gated_delta_prefill", q, k, v, g, beta, state_pool, slots, cu_seqlens,
                      has_initial)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    starts = cu_seqlens.tolist()
    for i, (slot, initial) in enumerate(zip(slots.tolist(), has_initial.tolist(), strict=True)):
        rows = slice(starts[i], starts[i + 1])
        hq, hk, hv, hg, hb = _float_heads(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                          use_qk_l2norm)
        state = state_pool[slot] if initial and slot >= 0 else torch.zeros_like(state_pool[0])
        seq_out, state = _chunked(hq * scale, hk, hv, hg, hb, state)
        if slot >= 0:
            state_pool[slot] = state
        out[rows] = seq_out.transpose(0, 1).to(q.dtype)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                       use_qk_l2norm: bool = True, scale: float | None = None,
                       has_initial: torch.Tensor | None = None) -> torch.Tensor:
    """One token of each sequence (``torch_recurrent_gated_delta_rule``): row ``b`` of ``q, k
    [B, Hk, K]``, ``v [B, Hv, V]``, ``g, beta [B, Hv]`` updates the state in
    ``state_pool[slots[b]]`` in place and reads it; where ``has_initial [B]`` is given and
    False it starts from zeros instead (a sequence's first token). A negative slot is a
    padding row (of a CUDA-graph batch): its output is zeros and no state is touched. Returns
    ``[B, Hv, V]`` in q's dtype."""
    check_gated_delta("gated_delta_decode", q, k, v, g, beta, state_pool, slots,
                      has_initial=has_initial)
    # [B, H, D] is [batch, heads, one token] already: no transpose (``_float_heads``' [H, T])
    hq, hk, hv, hg, hb = (x.transpose(0, 1) for x in _float_heads(q, k, v, g, beta,
                                                                   use_qk_l2norm))
    hq = hq / q.shape[-1] ** 0.5 if scale is None else hq * scale
    keep = slots >= 0
    state = state_pool[slots.clamp(min=0).long()]
    if has_initial is not None:
        state = torch.where(has_initial.bool()[:, None, None, None], state, 0)
    state = state * hg.exp()[..., None, None]
    kv_mem = (state * hk.unsqueeze(-1)).sum(dim=-2)
    delta = (hv - kv_mem) * hb.unsqueeze(-1)
    state = state + hk.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * hq.unsqueeze(-1)).sum(dim=-2)
    state_pool.index_copy_(0, slots[keep].long(), state[keep])
    return out.masked_fill(~keep[:, None, None], 0).to(q.dtype)
